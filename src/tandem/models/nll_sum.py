"""SFT's loss, the summed NLL of the targets, with its gradient computed in the same chunked pass.

`token_logprobs` keeps the backward general (any gradient per token, entropy, temperatures, kept ids), so it
recomputes every chunk of logits in the backward: a fourth LM-head matmul, and its weight gradient in fp32.
A plain sum has a gradient known up to one scalar, so here each chunk's `softmax - onehot` is formed once, in
the forward, over the chunk's logits in place, and both gradient matmuls run right away in the model dtype
(`fused_head`: the chunk loop, autocast and fp32 accumulation shared with RL's fused policy loss).
Logits are computed as `token_logprobs` does (matmul in the model dtype, softmax in fp32); on CUDA the
per-chunk softmax and gradient are one compiled kernel.
"""

from __future__ import annotations

import functools

import torch

from .fused_head import fused_head_loss
from .logprobs import DEFAULT_CHUNK_SIZE, IGNORE_INDEX


def _nll_and_grad_(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """NLL `[rows]` (fp32, 0 where not `valid`); `logits` is overwritten with the NLL's gradient with respect to
    it. Compiled (CUDA), the gradient is stored over the logits, so a chunk's logits and their gradient never take
    memory side by side (together they were the dense SFT step's memory peak: benchmarks/memory_sft.py,
    benchmarks/RESULTS.md); eager, fp32 temporaries of the chunk's size remain."""
    z = logits.float()
    lse = z.logsumexp(dim=-1, keepdim=True)
    nll = (lse - z.gather(1, targets[:, None])).squeeze(1) * valid
    is_target = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    logits.copy_(((z - lse).exp() - is_target.float()) * valid[:, None])
    return nll


@functools.cache
def _compiled_nll_and_grad_():
    return torch.compile(_nll_and_grad_, dynamic=False)


def fused_nll_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """`-sum(log_softmax(hidden @ weight.T)[target])` over targets that are not IGNORE_INDEX; a scalar (fp32).

    hidden `[..., H]`, weight `[V, H]`, targets `[...]`. Differentiable in hidden and weight; the result must be
    used as a loss (its gradient is formed in the forward, so it costs memory for `[V, H]` in fp32 until the
    backward).
    """
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    valid = targets != IGNORE_INDEX
    safe_targets = targets.masked_fill(~valid, 0)
    step = _compiled_nll_and_grad_() if flat.is_cuda else _nll_and_grad_

    def chunk_grad(logits: torch.Tensor, s: int, e: int) -> torch.Tensor:
        return step(logits, safe_targets[s:e], valid[s:e]).sum()

    return fused_head_loss(flat, weight, chunk_size, chunk_grad)
