"""Triton kernels for the inference engine's decode step: a layer in five small kernels plus its four GEMVs.

Decoding a small model at small batch is bound by how many kernels a step launches, not by bytes: the
op-by-op step is ~61 kernels per layer (an RMSNorm alone is eight: casts, pow, mean, add, rsqrt, muls).
These kernels cut a layer to: residual add + RMSNorm, the QKV GEMV, qk-norm + RoPE + KV-cache write, paged
attention reading K/V in place through the block table, the O GEMV, residual add + RMSNorm, the gate/up GEMV,
SiLU * up (`kernels.swiglu`), the down GEMV. `decode_attention` makes qk-norm + RoPE + cache write, the
attention and its split combine a single kernel.

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
def _norm_scale(x, inv_rms, weight, ROUND: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm's output given the row's `inv_rms`: the normalised value and its product with the weight, each
    rounded as eager rounds them."""
    return round_to(weight * round_to(x * inv_rms, ROUND, dtype), ROUND, dtype)


@triton.jit
def _rope(x, x_pair, cos, signed_sin, ROUND: tl.constexpr, dtype: tl.constexpr):
    """x * cos + rotate_half(x) * sin, rounded as eager rounds each product and the sum. `x_pair` is x at the
    other half's position and `signed_sin` is sin negated in the first half: rotate_half(x) = (-hi, lo)."""
    return round_to(round_to(x * cos, ROUND, dtype) + round_to(x_pair * signed_sin, ROUND, dtype), ROUND, dtype)


@triton.jit
def _normed_rotated(
    row_ptr, cols, mask, norm_ptr, eps, cos, signed_sin, QK_NORM: tl.constexpr, ROUND: tl.constexpr,
    dtype: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """The heads starting at columns `cols` `[R, 1]` of a fused qkv row, qk-normed (optional) and rotated by
    `cos` / `signed_sin` `[DIM]` as eager rounds them: fp32 `[R, DIM]` holding values of `dtype`."""
    dims = tl.arange(0, DIM)
    pair = (dims + DIM // 2) % DIM  # the other half's position: rotate_half pairs dim i with i +- DIM / 2
    x = tl.load(row_ptr + cols + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_pair = tl.load(row_ptr + cols + pair[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / DIM + eps)[:, None]
        x = _norm_scale(x, inv_rms, tl.load(norm_ptr + dims).to(tl.float32)[None, :], ROUND, dtype)
        x_pair = _norm_scale(x_pair, inv_rms, tl.load(norm_ptr + pair).to(tl.float32)[None, :], ROUND, dtype)
    return _rope(x, x_pair, cos[None, :], signed_sin[None, :], ROUND, dtype)


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
        lo, hi = _norm_scale(lo, inv_rms, weight_lo, ROUND, dtype), _norm_scale(hi, inv_rms, weight_hi, ROUND, dtype)
    cos_lo = tl.load(cos_ptr + token * 2 * HALF + dims).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * 2 * HALF + dims).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    out_lo, out_hi = _rope(lo, hi, cos_lo, -sin_lo, ROUND, dtype), _rope(hi, lo, cos_hi, sin_hi, ROUND, dtype)
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


def _qkv_heads(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    k_cache: torch.Tensor,
    smallest_dim: int,
) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a fused projection `[N, (Hq + 2 Hkv) * D]`, after checking them."""
    _, _, kv_heads, dim = k_cache.shape
    if dim & (dim - 1) or dim < smallest_dim:
        raise ValueError(f"the decode kernels need a power-of-two head_dim of at least {smallest_dim}, got {dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qk-norm needs both q_norm and k_norm weights, or neither")
    q_heads = qkv.shape[1] // dim - 2 * kv_heads
    if qkv.shape[1] % dim or q_heads <= 0 or q_heads % kv_heads:
        raise ValueError(
            f"qkv's {qkv.shape[1]} columns are not (Hq + 2 x {kv_heads}) heads of {dim}, Hq a multiple of {kv_heads}"
        )
    return q_heads, kv_heads, dim


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
    q_heads, kv_heads, dim = _qkv_heads(qkv, q_norm, k_norm, k_cache, smallest_dim=2)
    tokens = qkv.shape[0]
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
def _attend(
    q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, num_kv_heads, first, last, scale, best, total, acc,
    DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of queries `q` `[ROWS, DIM]` over the cached keys `[first, last)` of one KV head, read in
    place through the sequence's block table; carries (running max, sum of weights, unnormalised output)."""
    dims = tl.arange(0, DIM)
    for start in range(first, last, KEYS):
        keys = start + tl.arange(0, KEYS)
        key_mask = keys < last
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0)
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
    return best, total, acc


@triton.jit
def _combine(partial_ptr, stats_ptr, parts, row_mask, SPLITS: tl.constexpr, DIM: tl.constexpr):
    """The attention output `[R, DIM]` of query rows whose SPLITS partial softmaxes start at `parts` `[R]`.
    Loads bypass L1 (`.cg`): other programs of the same launch may have written the partials."""
    dims = tl.arange(0, DIM)
    best = tl.full(parts.shape, float("-inf"), tl.float32)
    for split in range(SPLITS):  # splits past a row's keys have best -inf: they weigh nothing
        best = tl.maximum(
            best, tl.load(stats_ptr + (parts + split) * 2, mask=row_mask, other=0.0, cache_modifier=".cg")
        )
    total = tl.zeros(parts.shape, tl.float32)
    acc = tl.zeros([parts.shape[0], DIM], tl.float32)
    for split in range(SPLITS):
        part = parts + split
        weight = tl.exp(tl.load(stats_ptr + part * 2, mask=row_mask, other=0.0, cache_modifier=".cg") - best)
        total += weight * tl.load(stats_ptr + part * 2 + 1, mask=row_mask, other=1.0, cache_modifier=".cg")
        rows = part[:, None] * DIM + dims[None, :]
        acc += weight[:, None] * tl.load(partial_ptr + rows, mask=row_mask[:, None], other=0.0, cache_modifier=".cg")
    return acc / total[:, None]


@triton.jit
def _store_attention(
    out_ptr, partial_ptr, stats_ptr, heads, row_mask, split, best, total, acc, SPLITS: tl.constexpr,
    DIM: tl.constexpr,
):  # fmt: skip
    """The output rows of query `heads` (`seq * Hq + head`): normalised, or this split's partial softmax."""
    dims = tl.arange(0, DIM)
    if SPLITS == 1:
        rows = heads[:, None] * DIM + dims[None, :]
        tl.store(out_ptr + rows, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = heads * SPLITS + split
        tl.store(partial_ptr + part[:, None] * DIM + dims[None, :], acc, mask=row_mask[:, None])
        tl.store(stats_ptr + part * 2, best, mask=row_mask)
        tl.store(stats_ptr + part * 2 + 1, total, mask=row_mask)


@triton.jit
def _paged_decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lengths_ptr, out_ptr, partial_ptr, stats_ptr, table_stride,
    num_kv_heads, scale, chunk, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    row_mask = rows < GROUP
    heads = seq * num_kv_heads * GROUP + kv_head * GROUP + rows  # this KV head's query heads: one tile's rows
    q = tl.load(q_ptr + heads[:, None] * DIM + dims[None, :], mask=row_mask[:, None], other=0.0)
    num_keys = tl.load(lengths_ptr + seq) + 1  # the cached tokens and the new one (written just before)
    first = split * chunk
    best, total, acc = _attend(
        q, k_cache_ptr, v_cache_ptr, tables_ptr + seq * table_stride, kv_head, num_kv_heads, first,
        tl.minimum(first + chunk, num_keys), scale, tl.full([ROWS], float("-inf"), tl.float32),
        tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, DIM], tl.float32), DIM, BLOCK_SIZE, KEYS, PRECISION,
    )  # fmt: skip
    _store_attention(out_ptr, partial_ptr, stats_ptr, heads, row_mask, split, best, total, acc, SPLITS, DIM)


@triton.jit
def _combine_splits_kernel(partial_ptr, stats_ptr, out_ptr, SPLITS: tl.constexpr, DIM: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    head_row = tl.program_id(0) + tl.arange(0, 1)  # token * Hq + head
    out = _combine(partial_ptr, stats_ptr, head_row * SPLITS, head_row >= 0, SPLITS, DIM)
    tl.store(out_ptr + head_row[:, None] * DIM + tl.arange(0, DIM)[None, :], out.to(out_ptr.dtype.element_ty))


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, write_index_ptr, tables_ptr,
    lengths_ptr, out_ptr, partial_ptr, stats_ptr, arrivals_ptr, table_stride, num_kv_heads, eps, scale, chunk,
    GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr,
    SPLITS: tl.constexpr, QK_NORM: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    row_mask = rows < GROUP
    qkv_row = qkv_ptr + seq * num_kv_heads * (GROUP + 2) * DIM  # Hq query heads, then Hkv key and Hkv value heads
    cos = tl.load(cos_ptr + seq * DIM + dims).to(tl.float32)
    signed_sin = tl.where(dims < DIM // 2, -1.0, 1.0) * tl.load(sin_ptr + seq * DIM + dims).to(tl.float32)
    # this KV head's query heads, qk-normed and rotated: one tile's rows
    q_cols = (kv_head * GROUP + rows)[:, None] * DIM
    q = _normed_rotated(
        qkv_row, q_cols, row_mask[:, None], q_norm_ptr, eps, cos, signed_sin, QK_NORM, ROUND, dtype, DIM
    ).to(dtype)
    # the cached keys of this split; the new token's key (position `length`) is not in the cache yet
    length = tl.load(lengths_ptr + seq)
    first = split * chunk
    best, total, acc = _attend(
        q, k_cache_ptr, v_cache_ptr, tables_ptr + seq * table_stride, kv_head, num_kv_heads, first,
        tl.minimum(first + chunk, length), scale, tl.full([ROWS], float("-inf"), tl.float32),
        tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, DIM], tl.float32), DIM, BLOCK_SIZE, KEYS, PRECISION,
    )  # fmt: skip
    if split == length // chunk:  # the split that holds the new key: rotate it, cache it with its value, attend
        k_cols = num_kv_heads * GROUP * DIM + kv_head * DIM + tl.zeros([1, 1], tl.int32)  # one row: [1, DIM]
        k = _normed_rotated(qkv_row, k_cols, k_cols >= 0, k_norm_ptr, eps, cos, signed_sin, QK_NORM, ROUND, dtype, DIM)
        v = tl.load(qkv_row + k_cols + num_kv_heads * DIM + dims[None, :])
        cache_row = (tl.load(write_index_ptr + seq) * num_kv_heads + kv_head) * DIM
        tl.store(k_cache_ptr + cache_row + dims[None, :], k.to(dtype))
        tl.store(v_cache_ptr + cache_row + dims[None, :], v)
        score = tl.sum(q.to(tl.float32) * k, axis=1) * scale
        new_best = tl.maximum(best, score)
        weight = tl.exp(score - new_best)
        rescale = tl.exp(best - new_best)
        total = total * rescale + weight
        acc = acc * rescale[:, None] + round_to(weight, ROUND, dtype)[:, None] * v.to(tl.float32)  # as `_attend`
        best = new_best
    heads = seq * num_kv_heads * GROUP + kv_head * GROUP + rows
    _store_attention(out_ptr, partial_ptr, stats_ptr, heads, row_mask, split, best, total, acc, SPLITS, DIM)
    if SPLITS > 1:  # the last split of this KV head to finish combines them all, then re-arms the counter
        tl.debug_barrier()  # every thread's partial stores come before the arrival's release
        arrivals = arrivals_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == SPLITS - 1:
            out = _combine(partial_ptr, stats_ptr, heads * SPLITS, row_mask, SPLITS, DIM)
            tl.store(out_ptr + heads[:, None] * DIM + dims[None, :], out.to(dtype), mask=row_mask[:, None])
            tl.store(arrivals, 0)


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


KEYS_PER_TILE = 64


def _split_keys(tokens: int, kv_heads: int, capacity: int, device: torch.device, splits: int | None) -> tuple[int, int]:
    """(keys per split, splits): by default enough splits of the key range for two programs per processor."""
    if splits is None:
        splits = -(-2 * _processors(device) // (tokens * kv_heads))
    chunk = -(-capacity // max(1, min(splits, -(-capacity // KEYS_PER_TILE))) // KEYS_PER_TILE) * KEYS_PER_TILE
    return chunk, -(-capacity // chunk)


def _attention_buffers(
    q_like: torch.Tensor, tokens: int, q_heads: int, dim: int, splits: int, min_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output `[max(N, min_rows), Hq * D]` and, when the keys are split, the partial softmaxes and their stats."""
    device = q_like.device
    out = torch.empty(max(tokens, min_rows), q_heads * dim, dtype=q_like.dtype, device=device)
    parts = tokens * q_heads * splits if splits > 1 else 0
    partial = torch.empty(parts * dim, dtype=torch.float32, device=device)
    return out, partial, torch.empty(parts * 2, dtype=torch.float32, device=device)


def _tile_flags(q_like: torch.Tensor, group: int, dim: int, block_size: int, splits: int) -> dict:
    return {
        "GROUP": group,
        "ROWS": max(16, triton.next_power_of_2(group)),
        "DIM": dim,
        "BLOCK_SIZE": block_size,
        "KEYS": KEYS_PER_TILE,
        "SPLITS": splits,
        "PRECISION": "ieee" if q_like.dtype == torch.float32 else "tf32",
    }


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
    chunk, splits = _split_keys(tokens, kv_heads, tables.shape[1] * block_size, q.device, splits)
    out, partial, stats = _attention_buffers(q, tokens, q_heads, dim, splits, min_rows)
    _paged_decode_attention_kernel[(tokens, kv_heads, splits)](
        q, k_cache, v_cache, tables, lengths, out, partial, stats, tables.stride(0), kv_heads, scale, chunk,
        **_tile_flags(q, q_heads // kv_heads, dim, block_size, splits), **launch_flags(pdl),
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(tokens * q_heads,)](partial, stats, out, SPLITS=splits, DIM=dim, **launch_flags(pdl))
    return out


def arrival_counters(tokens: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for `decode_attention`'s split combine, one per sequence and KV head."""
    return torch.zeros(tokens * kv_heads, dtype=torch.int32, device=device)


def decode_attention(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_index: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int | None = None,
    min_rows: int = 1,
    pdl: bool = False,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qk_norm_rope_store` and `paged_decode_attention` (with its split combine) as one kernel.

    From the fused projection `qkv` `[N, (Hq + 2 Hkv) * D]`, each program normalises and rotates its query
    heads itself; the program whose key range holds the new token rotates that token's key, writes it and its
    value to the cache and attends to them from registers (no program reads the cache row being written), and
    the last program of a KV head to finish its split combines the splits (an arrival counter per sequence and
    KV head, left at zero for the next launch). `[max(N, min_rows), Hq * D]`, as `paged_decode_attention`.

    `arrivals`: zeroed int32 counters, at least N x Hkv, that every launch leaves zeroed, so the layers of a
    step share one (`arrival_counters`); by default a new one per call."""
    q_heads, kv_heads, dim = _qkv_heads(qkv, q_norm, k_norm, k_cache, smallest_dim=16)  # 16: tl.dot's least
    tokens, block_size = qkv.shape[0], k_cache.shape[1]
    chunk, splits = _split_keys(tokens, kv_heads, tables.shape[1] * block_size, qkv.device, splits)
    out, partial, stats = _attention_buffers(qkv, tokens, q_heads, dim, splits, min_rows)
    if arrivals is None:
        arrivals = arrival_counters(tokens, kv_heads, qkv.device)
    if arrivals.numel() < tokens * kv_heads or arrivals.dtype != torch.int32 or arrivals.device != qkv.device:
        raise ValueError(f"arrivals must hold at least {tokens * kv_heads} int32 counters on {qkv.device}")
    if tables.dtype != torch.int64 or write_index.dtype != torch.int64:
        raise ValueError("block tables and write indices must be int64 (cache offsets are computed from them)")
    qk_norm = q_norm is not None
    _decode_attention_kernel[(tokens, kv_heads, splits)](
        qkv, q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, cos, sin, k_cache, v_cache, write_index,
        tables, lengths, out, partial, stats, arrivals, tables.stride(0), kv_heads, eps, scale, chunk,
        **_tile_flags(qkv, q_heads // kv_heads, dim, block_size, splits), QK_NORM=qk_norm,
        ROUND=qkv.dtype != torch.float32, enable_fp_fusion=False, **launch_flags(pdl),
    )  # fmt: skip
    return out
