"""Triton kernels for the inference engine's decode step: a layer in five small kernels plus its four GEMVs.

Decoding a small model at small batch is bound by how many kernels a step launches, not by bytes: the
op-by-op step is ~61 kernels per layer (an RMSNorm alone is eight: casts, pow, mean, add, rsqrt, muls).
These kernels cut a layer to: residual add + RMSNorm, the QKV GEMV, qk-norm + RoPE + KV-cache write, paged
attention reading K/V in place through the block table, the O GEMV, residual add + RMSNorm, the gate/up GEMV,
SiLU * up (`kernels.swiglu`), the down GEMV.

Numerics follow the op-by-op model (`tandem.models`): fp32 math, rounded to the activation dtype where
eager PyTorch rounds (after the residual add, the normalised row, each RoPE product and sum, SiLU and the
product), so outputs agree with it to the activation dtype's rounding; fp32 reductions (mean of squares,
softmax) sum in a different order, so they are close, not bit-identical. Attention is an online softmax in
fp32 over tiles of keys, split over programs at small batches (flash-decoding).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tandem.kernels.rounding import round_to


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Launched as a programmatic dependent (`pdl`): wait until the previous kernel has finished and its writes
    are visible, then let the next kernel launch (it waits in turn). Without PDL, stream order does this."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_flags(pdl: bool) -> dict[str, bool]:
    """The `PDL` constexpr and, when set, the launch option that makes a kernel a programmatic dependent."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def _add_rms_norm_kernel(
    delta_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = round_to(x + tl.load(delta_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32), ROUND, dtype)
        tl.store(residual_ptr + row * hidden + cols, x.to(dtype), mask=mask)
    normed = round_to(x * tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps), ROUND, dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (weight * normed).to(dtype), mask=mask)


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += delta` in place (when given), then RMSNorm(residual) as a new tensor; rows `[N, hidden]`."""
    rows, hidden = residual.shape
    out = torch.empty_like(residual)
    _add_rms_norm_kernel[(rows,)](
        residual if delta is None else delta,
        residual,
        weight,
        out,
        hidden,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=triton.next_power_of_2(hidden),
        ROUND=residual.dtype != torch.float32,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    write_index_ptr,
    num_q_heads,
    num_kv_heads,
    eps,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token, head = tl.program_id(0), tl.program_id(1)  # heads: the q heads, then the k heads (v rides with k)
    dtype = q_out_ptr.dtype.element_ty
    dims = tl.arange(0, HALF)
    row = qkv_ptr + token * (num_q_heads + 2 * num_kv_heads) * 2 * HALF
    lo = tl.load(row + head * 2 * HALF + dims).to(tl.float32)
    hi = tl.load(row + head * 2 * HALF + HALF + dims).to(tl.float32)
    is_q = head < num_q_heads
    if QK_NORM:
        weight_lo = tl.where(is_q, tl.load(q_norm_ptr + dims), tl.load(k_norm_ptr + dims)).to(tl.float32)
        weight_hi = tl.where(is_q, tl.load(q_norm_ptr + HALF + dims), tl.load(k_norm_ptr + HALF + dims)).to(tl.float32)
        inv_rms = tl.math.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
        lo = round_to(weight_lo * round_to(lo * inv_rms, ROUND, dtype), ROUND, dtype)
        hi = round_to(weight_hi * round_to(hi * inv_rms, ROUND, dtype), ROUND, dtype)
    cos_lo = tl.load(cos_ptr + token * 2 * HALF + dims).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * 2 * HALF + dims).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-hi, lo)
    out_lo = round_to(round_to(lo * cos_lo, ROUND, dtype) + round_to(-(hi * sin_lo), ROUND, dtype), ROUND, dtype)
    out_hi = round_to(round_to(hi * cos_hi, ROUND, dtype) + round_to(lo * sin_hi, ROUND, dtype), ROUND, dtype)
    if is_q:
        out = q_out_ptr + (token * num_q_heads + head) * 2 * HALF
        tl.store(out + dims, out_lo.to(dtype))
        tl.store(out + HALF + dims, out_hi.to(dtype))
    else:
        kv_head = head - num_q_heads
        cache_row = (tl.load(write_index_ptr + token) * num_kv_heads + kv_head) * 2 * HALF
        tl.store(k_cache_ptr + cache_row + dims, out_lo.to(dtype))
        tl.store(k_cache_ptr + cache_row + HALF + dims, out_hi.to(dtype))
        v_row = row + (num_q_heads + num_kv_heads + kv_head) * 2 * HALF
        tl.store(v_cache_ptr + cache_row + dims, tl.load(v_row + dims))
        tl.store(v_cache_ptr + cache_row + HALF + dims, tl.load(v_row + HALF + dims))


def qk_norm_rope_store(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_index: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """Split fused `qkv` `[N, (Hq + 2 Hkv) * D]`; qk-norm (optional) and rotate q and k by cos/sin `[N, D]`;
    write k and v to the cache rows `write_index` `[N]` (cache `[blocks, block_size, Hkv, D]`); return q
    `[N, Hq, D]`.

    `pdl`, here and in `paged_decode_attention`: launch as a programmatic dependent of the previous kernel
    (`gemv.pdl_supported`)."""
    _, _, kv_heads, dim = k_cache.shape
    tokens = qkv.shape[0]
    q_heads = qkv.shape[1] // dim - 2 * kv_heads
    if dim & (dim - 1) or dim < 2:
        raise ValueError(f"the decode kernels need a power-of-two head_dim, got {dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qk-norm needs both q_norm and k_norm weights, or neither")
    q = torch.empty(tokens, q_heads, dim, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm is not None
    _qk_norm_rope_store_kernel[(tokens, q_heads + kv_heads)](
        qkv,
        q_norm if qk_norm else qkv,
        k_norm if qk_norm else qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        write_index,
        q_heads,
        kv_heads,
        eps,
        HALF=dim // 2,
        QK_NORM=qk_norm,
        ROUND=qkv.dtype != torch.float32,
        enable_fp_fusion=False,
        **launch_flags(pdl),
    )
    return q


@triton.jit
def _paged_decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    lengths_ptr,
    out_ptr,
    partial_ptr,
    stats_ptr,
    table_stride,
    num_kv_heads,
    scale,
    chunk,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows  # the query heads of this KV head: one tile's rows (padded to ROWS)
    q_rows = (seq * num_kv_heads * GROUP + heads)[:, None] * DIM + dims[None, :]
    q = tl.load(q_ptr + q_rows, mask=row_mask[:, None], other=0.0)
    num_keys = tl.load(lengths_ptr + seq) + 1  # the cached tokens and the new one (written just before)
    first, last = split * chunk, tl.minimum(split * chunk + chunk, num_keys)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    for start in range(first, last, KEYS):
        keys = start + tl.arange(0, KEYS)
        key_mask = keys < last
        block = tl.load(tables_ptr + seq * table_stride + keys // BLOCK_SIZE, mask=key_mask, other=0)
        kv_rows = ((block * BLOCK_SIZE + keys % BLOCK_SIZE) * num_kv_heads + kv_head)[:, None] * DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_rows, mask=key_mask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        v = tl.load(v_cache_ptr + kv_rows, mask=key_mask[:, None], other=0.0)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        best = new_best
    if SPLITS == 1:
        tl.store(out_ptr + q_rows, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:  # this split's running max, sum and unnormalised output, combined by `_combine_splits_kernel`
        part = (seq * num_kv_heads * GROUP + heads) * SPLITS + split
        tl.store(partial_ptr + part[:, None] * DIM + dims[None, :], acc, mask=row_mask[:, None])
        tl.store(stats_ptr + part * 2, best, mask=row_mask)
        tl.store(stats_ptr + part * 2 + 1, total, mask=row_mask)


@triton.jit
def _combine_splits_kernel(
    partial_ptr, stats_ptr, out_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    head_row = tl.program_id(0)  # token * Hq + head
    splits = tl.arange(0, SPLITS_PAD)
    mask = splits < SPLITS
    part = head_row * SPLITS + splits
    best = tl.load(stats_ptr + part * 2, mask=mask, other=float("-inf"))
    total = tl.load(stats_ptr + part * 2 + 1, mask=mask, other=0.0)
    weight = tl.exp(best - tl.max(best, axis=0))  # splits past the sequence's keys have best -inf: weight 0
    dims = tl.arange(0, DIM)
    acc = tl.load(partial_ptr + part[:, None] * DIM + dims[None, :], mask=mask[:, None], other=0.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * total, axis=0)
    tl.store(out_ptr + head_row * DIM + dims, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int | None = None,
    min_rows: int = 1,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one new query per sequence, q `[N, Hq, D]`, over its `lengths[i] + 1` cached keys, read in
    place through the block table `tables` `[N, W]` (no gather); `[max(N, min_rows), Hq * D]`, where rows past
    N are padding for the GEMM that follows (never written; their products are to be dropped).

    Query heads sharing a KV head are one program's rows, so each K/V row is read once per sequence. When
    sequences x KV heads would leave processors idle (small batches), the key range is split over `splits`
    programs (default: enough for two per processor) whose partial softmaxes a second kernel combines.
    """
    tokens, q_heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    capacity = tables.shape[1] * block_size
    keys = 64
    if splits is None:
        splits = -(-2 * _processors(q.device) // (tokens * kv_heads))
    chunk = -(-capacity // max(1, min(splits, -(-capacity // keys))) // keys) * keys
    splits = -(-capacity // chunk)
    out = torch.empty(max(tokens, min_rows), q_heads * dim, dtype=q.dtype, device=q.device)
    partial = torch.empty(tokens * q_heads * splits * dim if splits > 1 else 0, dtype=torch.float32, device=q.device)
    stats = torch.empty(tokens * q_heads * splits * 2 if splits > 1 else 0, dtype=torch.float32, device=q.device)
    _paged_decode_attention_kernel[(tokens, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        tables,
        lengths,
        out,
        partial,
        stats,
        tables.stride(0),
        kv_heads,
        scale,
        chunk,
        GROUP=group,
        ROWS=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        BLOCK_SIZE=block_size,
        KEYS=keys,
        SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **launch_flags(pdl),
    )
    if splits > 1:
        _combine_splits_kernel[(tokens * q_heads,)](
            partial, stats, out, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), DIM=dim, **launch_flags(pdl)
        )
    return out
