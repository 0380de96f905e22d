"""DeepSeek-V3.2's lightning-indexer scores as one Triton kernel (the reference: `tandem.models.layers.indexer.
index_scores`, which transformers' `DeepseekV32Indexer` computes op for op).

    out[b, s, t] = sum_h w[b, s, h] * relu(scale * q[b, s, h] . k[b, t])     where key t is allowed, else -inf

The torch reference materialises the per-head scores `[B, S, H, T]` in fp32 (H = 64 for the released model,
so 64x the output); here each program owns a `[BLOCK_S, BLOCK_T]` tile of the output, keeps its keys in
registers and accumulates the heads one `tl.dot` at a time, so only `[B, S, T]` is ever written. Tiles with no
allowed key (above the causal diagonal, across documents) skip the head loop and store -inf.

fp32 inputs are multiplied in IEEE fp32 (no TF32), bf16/fp16 ones on tensor cores with fp32 accumulation (their
products are exact in fp32, as in the reference's upcast matmul); the sum over heads runs in another order than
the reference's matmul, so results agree to fp32 rounding, not bit for bit. The top-k that follows stays in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _index_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    allowed_ptr,
    out_ptr,
    seq,
    keys,
    heads,
    dim,
    scale,
    causal_offset,
    q_stride_b,
    q_stride_s,
    q_stride_h,
    k_stride_b,
    k_stride_t,
    w_stride_b,
    w_stride_s,
    a_stride_b,
    a_stride_s,
    o_stride_b,
    o_stride_s,
    HAS_ALLOWED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < seq) & (cols[None, :] < keys)
    if HAS_ALLOWED:
        a_ptrs = allowed_ptr + b * a_stride_b + rows[:, None] * a_stride_s + cols[None, :]
        ok = (tl.load(a_ptrs, mask=inside, other=0) != 0) & inside
    else:
        ok = (cols[None, :] <= rows[:, None] + causal_offset) & inside
    active_heads = tl.where(tl.max(ok.to(tl.int32)) > 0, heads, 0)
    k_ptrs = k_ptr + b * k_stride_b + cols[:, None] * k_stride_t + dims[None, :]
    k = tl.load(k_ptrs, mask=(cols[:, None] < keys) & (dims[None, :] < dim), other=0.0)
    q_mask = (rows[:, None] < seq) & (dims[None, :] < dim)
    q_base = q_ptr + b * q_stride_b + rows[:, None] * q_stride_s + dims[None, :]
    w_base = w_ptr + b * w_stride_b + rows * w_stride_s
    acc = tl.zeros([BLOCK_S, BLOCK_T], dtype=tl.float32)
    for h in range(0, active_heads):
        q = tl.load(q_base + h * q_stride_h, mask=q_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        w = tl.load(w_base + h, mask=rows < seq, other=0.0).to(tl.float32)
        acc += w[:, None] * tl.maximum(s * scale, 0.0)
    out = tl.where(ok, acc, float("-inf"))
    tl.store(out_ptr + b * o_stride_b + rows[:, None] * o_stride_s + cols[None, :], out, mask=inside)


def index_scores_triton(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, allowed: torch.Tensor | None
) -> torch.Tensor:
    """Masked indexer scores `[B, S, T]` fp32 of `q` `[B, S, H, D]`, `k` `[B, T, D]`, fp32 head weights
    `[B, S, H]`; `allowed` `[B, S, T]` bool (None: causal, the S queries being the last S of the T keys)."""
    batch, seq, heads, dim = q.shape
    keys = k.shape[1]
    if k.shape != (batch, keys, dim) or weights.shape != (batch, seq, heads):
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)}")
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    weights = weights.float()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    out = torch.empty(batch, seq, keys, dtype=torch.float32, device=q.device)
    if allowed is not None:
        if allowed.shape != (batch, seq, keys):
            raise ValueError(f"allowed must be [B, S, T] = {(batch, seq, keys)}, got {tuple(allowed.shape)}")
        allowed = allowed if allowed.stride(-1) == 1 else allowed.contiguous()
        allowed_arg, a_strides = allowed.view(torch.uint8), (allowed.stride(0), allowed.stride(1))
    else:
        allowed_arg, a_strides = out, (0, 0)
    block = 16 if q.device.type != "cuda" else 64
    grid = (triton.cdiv(seq, block), triton.cdiv(keys, block), batch)
    _index_scores_kernel[grid](
        q,
        k,
        weights,
        allowed_arg,
        out,
        seq,
        keys,
        heads,
        dim,
        float(scale),
        keys - seq,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        weights.stride(0),
        weights.stride(1),
        *a_strides,
        out.stride(0),
        out.stride(1),
        HAS_ALLOWED=allowed is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32: the default, ignored for 16-bit inputs
        BLOCK_S=block,
        BLOCK_T=block,
        BLOCK_D=triton.next_power_of_2(max(dim, 16)),
    )
    return out
