"""`x @ weight.T` for a few rows of x: a Triton GEMV that streams the weight once, for small decode batches.

At batch 1-8 a linear layer reads its whole weight to produce a handful of outputs, so it runs at the memory
bandwidth at best. cuBLAS picks tiled GEMM kernels (often split-K plus a reduction kernel) that reach about
half of it on the mid-sized matrices of a decoder layer. Here each program owns a strip of output features and
walks the input dimension in wide, coalesced tiles, keeping all rows' partial sums in fp32 registers; the tile
shape is autotuned per (rows, out, in) on first use (outside CUDA-graph capture: the engine warms up first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8
"""Up to this many rows the GEMV is used; past it the tensor-core GEMMs are faster."""

TILES = [(8, 256, 4), (16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 256, 4), (32, 512, 8), (64, 128, 4), (64, 256, 8)]
"""(BLOCK_N, BLOCK_K, num_warps) tile shapes benchmarks/gemv.py sweeps."""


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    rows,
    out_features,
    in_features,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < out_features
    row_ids = tl.arange(0, ROWS)
    row_mask = row_ids < rows
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for start in range(0, in_features, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < in_features
        w = tl.load(
            w_ptr + features[:, None] * in_features + cols[None, :],
            mask=feature_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.load(
            x_ptr + row_ids[:, None] * in_features + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + features, mask=feature_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + row_ids[:, None] * out_features + features[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & feature_mask[None, :],
    )


def default_tile(rows: int, out_features: int, device: torch.device) -> tuple[int, int, int]:
    """The widest output strip that still gives every processor two programs; as many columns a step as keep
    rows x strip x columns at 8K fp32 values (registers)."""
    programs = 2 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1)
    block_n = next((n for n in (64, 32, 16) if triton.cdiv(out_features, n) >= programs), 8)
    block_k = max(64, min(512, 8192 // (triton.next_power_of_2(rows) * block_n)))
    return block_n, block_k, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for contiguous x `[rows <= MAX_ROWS, in]` and weight `[out, in]`;
    `tile` = (BLOCK_N, BLOCK_K, num_warps), default `default_tile`."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows > MAX_ROWS or not x.is_contiguous() or not weight.is_contiguous():
        raise ValueError(f"gemv takes contiguous x of at most {MAX_ROWS} rows and a contiguous weight")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tile or default_tile(rows, out_features, x.device)
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        out,
        rows,
        out_features,
        in_features,
        HAS_BIAS=bias is not None,
        ROWS=max(1, triton.next_power_of_2(rows)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out
