"""Gumbel-max sampling over the whole vocabulary in one pass over the logits: the token, and the logsumexp its
logprob needs.

The sampler draws a row's token as `argmax(z + g)`, `z` the tempered logits and `g` Gumbel noise hashed from
(row key, token id), so a seed gives the same token whatever else is in the batch. In plain torch that noise
is about twenty int64 elementwise passes over `[rows, vocab]`: at 256 rows of Qwen3's 151,936-token vocabulary
each pass moves ~0.6 GB, and the draw took longer than the model's decode step. Here each program reads one
block of one row once, hashes in registers and leaves four numbers (the block's best pick and its index, the
max of `z` and the sum of `exp(z - max)`); `gumbel_max` combines the blocks of a row.

Numerics follow `tandem.inference.sampling.gumbel_noise` up to a few ulps of the noise: the same 32-bit hash,
the same uint32 -> fp32 rounding, `log1p(-u)` to full precision (Goldberg's `log(w) * x / (w - 1)` with
`w = 1 + x`, which needs only `log`: Triton's interpreter has no libdevice), and ties resolved to the lowest
token id, as `torch.argmax`. A token differs from torch's only where two candidates tie to within those ulps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
_MIX = (0x21F0AAAD, 0x735A2D97)


@triton.jit
def _mix32(x):
    """`sampling.mix32` on uint32 values: the multiplications wrap mod 2**32 as the int64 version's masks do."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _gumbel_max_kernel(
    logits_ptr, row_stride, divisor_ptr, sampled_ptr, key_a_ptr, key_b_ptr, vocab,
    pick_ptr, index_ptr, max_ptr, sum_ptr, blocks, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    logits = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=valid, other=float("-inf"))
    z = logits.to(tl.float32) / tl.load(divisor_ptr + row)
    key_a = tl.load(key_a_ptr + row).to(tl.uint32)
    key_b = tl.load(key_b_ptr + row).to(tl.uint32)
    bits = _mix32(_mix32(cols.to(tl.uint32) ^ key_a) ^ key_b)
    uniform = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 1.0 - 5.960464477539063e-08)
    shifted = 1.0 - uniform  # exact for uniform >= 0.5, where the noise is smallest
    log1p = tl.where(shifted == 1.0, -uniform, tl.log(shifted) * -uniform / (shifted - 1.0))
    noise = -tl.log(-log1p)
    pick = tl.where(tl.load(sampled_ptr + row) != 0, z + noise, z)
    pick = tl.where(valid, pick, float("-inf"))
    best = tl.argmax(pick, axis=0, tie_break_left=True)
    top = tl.max(z, axis=0)
    total = tl.sum(tl.where(valid & (z > float("-inf")), tl.exp(z - top), 0.0), axis=0)
    out = row * blocks + block
    tl.store(pick_ptr + out, tl.max(pick, axis=0))
    tl.store(index_ptr + out, block * BLOCK + best)
    tl.store(max_ptr + out, top)
    tl.store(sum_ptr + out, total)


def gumbel_max(
    logits: torch.Tensor, divisor: torch.Tensor, sampled: torch.Tensor, key_a: torch.Tensor, key_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens `[R]` int64, logprobs `[R]` fp32) of `[R, V]` logits (any float dtype): per row, the argmax of
    `logits / divisor` plus Gumbel noise keyed by (`key_a`, `key_b`, token id) where `sampled` is true, else of
    `logits / divisor` alone, and that token's log-probability under `softmax(logits / divisor)`.

    `divisor` fp32 `[R]`; `sampled` bool `[R]`; `key_a`, `key_b` int64 `[R]` below 2**32
    (`tandem.inference.sampling.row_keys`)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    blocks = triton.cdiv(vocab, BLOCK)
    pick = torch.empty(rows, blocks, dtype=torch.float32, device=logits.device)
    index = torch.zeros(rows, blocks, dtype=torch.int32, device=logits.device)  # in range even if never written
    maxes, sums = torch.empty_like(pick), torch.empty_like(pick)
    _gumbel_max_kernel[(rows, blocks)](
        logits, logits.stride(0), divisor.contiguous(), sampled.to(torch.int8), key_a.contiguous(),
        key_b.contiguous(), vocab, pick, index, maxes, sums, blocks, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    tokens = index.gather(1, pick.argmax(dim=1, keepdim=True))[:, 0].long()
    top = maxes.max(dim=1).values
    lse = top + (sums * (maxes - top[:, None]).exp()).sum(dim=1).log()
    chosen = logits.gather(1, tokens[:, None])[:, 0].float() / divisor
    return tokens, chosen - lse
