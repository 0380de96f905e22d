"""SFT's loss, the summed NLL of the targets, with its gradient computed in the same chunked pass.

`token_logprobs` keeps the backward general (any gradient per token, entropy, temperatures, kept sets), so it
recomputes every chunk of logits in the backward: a fourth LM-head matmul, and its weight gradient in fp32.
A plain sum has a gradient known up to one scalar, so here each chunk's `softmax - onehot` is formed once, in
the forward, over the chunk's logits in place, and both gradient matmuls run right away in the model dtype;
the backward only scales them.
The LM head then costs the three matmuls any training step needs, and at most one chunk of logits and
its gradient exist at a time. Logits are computed as `token_logprobs` does (matmul in the model dtype,
softmax in fp32); on CUDA the per-chunk softmax and gradient are one compiled kernel.

Under autocast (fp32 weights, bf16 matmuls) the weight is cast once for every chunk, not per matmul, and on
CUDA the weight gradient's GEMMs accumulate straight into the fp32 sum (`out_dtype`), with no bf16 product
and no separate add.
"""

from __future__ import annotations

import functools

import torch

from .layers.precision import autocast_dtype
from .logprobs import DEFAULT_CHUNK_SIZE, IGNORE_INDEX


def _nll_and_grad_(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """NLL `[rows]` (fp32, 0 where not `valid`); `logits` is overwritten with the NLL's gradient with respect to
    it. Compiled (CUDA), the gradient is stored over the logits, so a chunk's logits and their gradient never take
    memory side by side (that was the step's peak, measured by benchmarks/memory_sft.py: 4.6 GiB for Qwen3-1.7B's
    16,384 tokens); eager, fp32 temporaries of the chunk's size remain."""
    z = logits.float()
    lse = z.logsumexp(dim=-1, keepdim=True)
    nll = (lse - z.gather(1, targets[:, None])).squeeze(1) * valid
    is_target = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    logits.copy_(((z - lse).exp() - is_target.float()) * valid[:, None])
    return nll


@functools.cache
def _compiled_nll_and_grad_():
    return torch.compile(_nll_and_grad_, dynamic=False)


def _add_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`total + a @ b` in fp32 (`total` None: zero), `a`, `b` in the matmul dtype."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):  # cuBLAS writes (and adds) fp32 directly
        if total is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(total, a, b, out_dtype=torch.float32)
    product = (a @ b).float()
    return product if total is None else total + product


class _FusedNllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
        valid = targets != IGNORE_INDEX
        safe_targets = targets.masked_fill(~valid, 0)
        step = _compiled_nll_and_grad_() if hidden.is_cuda else _nll_and_grad_
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None
        total = hidden.new_zeros((), dtype=torch.float32)
        dtype = autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # casts are explicit: the weight once, not per chunk
            matrix = weight.to(dtype)
            for s in range(0, hidden.shape[0], chunk_size):
                e = min(s + chunk_size, hidden.shape[0])
                rows = hidden[s:e].to(dtype)
                grad_logits = rows @ matrix.T  # the logits, until `step` overwrites them with their gradient
                total += step(grad_logits, safe_targets[s:e], valid[s:e]).sum()
                if grad_hidden is not None:
                    grad_hidden[s:e] = grad_logits @ matrix
                if need_weight:
                    grad_weight = _add_product(grad_weight, grad_logits.T, rows)  # summed over chunks in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype, ctx.consumed = weight.dtype, False
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        # Scaled in place: a second [V, H] fp32 buffer at the start of the backward, while every activation is
        # still alive, would raise the step's peak memory by its size. So this backward runs once.
        if ctx.consumed:
            raise RuntimeError("fused_nll_sum's backward runs once (it scales its saved gradients in place)")
        ctx.consumed = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def fused_nll_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """`-sum(log_softmax(hidden @ weight.T)[target])` over targets that are not IGNORE_INDEX; a scalar (fp32).

    hidden `[..., H]`, weight `[V, H]`, targets `[...]`. Differentiable in hidden and weight; the result must be
    used as a loss (its gradient is formed in the forward, so it costs memory for `[V, H]` in fp32 until the
    backward).
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _FusedNllSum.apply(flat, weight, targets.reshape(-1), chunk_size)
