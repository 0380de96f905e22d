"""LM-head losses whose gradient is formed in the forward, chunk by chunk: the loop, casts and autograd glue.

A loss that is a sum over tokens of a function of each token's logits has, within one chunk of tokens, a
gradient with respect to those logits that is known before any backward: `chunk_grad` computes the chunk's
loss and overwrites the chunk's logits with their gradient, and both gradient matmuls run right away
(`grad_hidden = grad_logits @ W`, `grad_W += grad_logits.T @ hidden`). The LM head then costs the three
matmuls any training step needs (no recompute in the backward), and at most one chunk of logits exists at a
time. The price is `[V, H]` fp32 for the summed weight gradient, held from the forward to the backward, and
`[T, H]` for the hidden states' gradient; the backward only scales them by the incoming scalar gradient.

Matmuls run in the model dtype: under autocast (fp32 weights, bf16 matmuls) the weight is cast once for every
chunk, not per matmul; on CUDA the weight gradient's GEMMs accumulate straight into the fp32 sum (`out_dtype`),
with tensor cores, no bf16 product and no separate add.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers.precision import autocast_dtype

# chunk_grad(logits [rows, V] in the matmul dtype, start, end) -> the chunk's loss, a 0-d fp32 tensor; it
# overwrites `logits` with the gradient of that loss with respect to them.
ChunkGrad = Callable[[torch.Tensor, int, int], torch.Tensor]


def add_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`total + a @ b` in fp32 (`total` None: zero), `a`, `b` in the matmul dtype.

    On CUDA in bf16/fp16, cuBLAS writes (and adds) fp32 directly. Elsewhere the product is formed in the
    operands' dtype and added in fp32 (CPU has no `out_dtype` GEMM).
    """
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if total is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(total, a, b, out_dtype=torch.float32)
    product = (a @ b).float()
    return product if total is None else total + product


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        chunk_size: int,
        chunk_grad: ChunkGrad,
        need_hidden: bool,
        need_weight: bool,
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None
        total = hidden.new_zeros((), dtype=torch.float32)
        dtype = autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # casts are explicit: the weight once, not per chunk
            matrix = weight.to(dtype)
            for s in range(0, hidden.shape[0], chunk_size):
                e = min(s + chunk_size, hidden.shape[0])
                rows = hidden[s:e].to(dtype)
                grad_logits = rows @ matrix.T  # the logits, until `chunk_grad` overwrites them with their gradient
                total += chunk_grad(grad_logits, s, e)
                if grad_hidden is not None:
                    grad_hidden[s:e] = grad_logits @ matrix
                if need_weight:
                    grad_weight = add_product(grad_weight, grad_logits.T, rows)  # summed over chunks in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype, ctx.consumed = weight.dtype, False
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        # Scaled in place: a second [V, H] fp32 buffer at the start of the backward, while every activation is
        # still alive, would raise the step's peak memory by its size. So this backward runs once.
        if ctx.consumed:
            raise RuntimeError("a fused LM-head loss's backward runs once (it scales its saved gradients in place)")
        ctx.consumed = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int, chunk_grad: ChunkGrad) -> torch.Tensor:
    """Σ over chunks of `chunk_grad`'s losses, a 0-d fp32 tensor differentiable in `hidden` `[T, H]` and `weight`
    `[V, H]`; the gradients are formed here, so use the result as a loss, once (its backward cannot replay)."""
    grad = torch.is_grad_enabled()
    return _FusedHeadLoss.apply(
        hidden, weight, chunk_size, chunk_grad, grad and hidden.requires_grad, grad and weight.requires_grad
    )
