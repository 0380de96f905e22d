"""Batch-1 linear layers of the decode step: `x @ W.T` for one row, streaming W once, with the layer's
residual add + RMSNorm fused before it and SwiGLU after it.

At batch 1 a decode step is bound by how many kernels it launches as much as by bytes: cuBLAS's GEMV needs
the norm and the activation as kernels of their own, and each kernel boundary in a CUDA graph idles the GPU
for about as long as a small projection takes. Here each program owns `BLOCK_N` output features (with SwiGLU:
BLOCK_N gate rows and the matching up rows) and walks the input in `BLOCK_K`-wide coalesced tiles, keeping an
fp32 partial product per (feature, column) and reducing it once at the end.

With `pdl` (Hopper and newer), kernels launch as programmatic dependents: a program loads its first weight
tile, which no earlier kernel writes, then waits (`gdc_wait`) for the previous kernel to finish before it
reads activations, so the weight stream overlaps the previous kernel's tail and the launch gap.

Numerics follow eager PyTorch in the activation dtype: the residual add, the normalised row, the norm's
product, each projection's output and SiLU and the SwiGLU product are rounded where eager rounds them; sums
are fp32, in another order than cuBLAS's, so results are close to `F.linear`'s, not bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.decode import launch_flags, wait_for_previous_kernel
from tandem.kernels.rounding import round_to

TILES = [
    (1, 1024, 4),
    (2, 512, 4),
    (2, 1024, 4),
    (2, 2048, 8),
    (4, 512, 4),
    (4, 1024, 4),
    (8, 256, 4),
    (8, 512, 4),
    (8, 1024, 8),
    (16, 256, 4),
]
"""(BLOCK_N, BLOCK_K, warps) candidates, autotuned per shape on CUDA; benchmarks/gemv.py times each."""
CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in TILES]
INTERPRETER_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 64}


@triton.jit
def _input_tile(x_ptr, delta_ptr, cols, mask, HAS_DELTA: tl.constexpr, ROUND: tl.constexpr, dtype: tl.constexpr):
    """x (+ delta, rounded as eager's residual add) at `cols`, in fp32."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = round_to(x + tl.load(delta_ptr + cols, mask=mask, other=0.0).to(tl.float32), ROUND, dtype)
    return x


@triton.jit
def _x_tile(
    x_ptr, delta_ptr, norm_ptr, cols, mask, inv_rms, NORM: tl.constexpr, HAS_DELTA: tl.constexpr,
    ROUND: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """The GEMV's input at `cols`: x, or RMSNorm(x + delta) given the row's `inv_rms`."""
    x = _input_tile(x_ptr, delta_ptr, cols, mask, HAS_DELTA, ROUND, dtype)
    if NORM:
        weight = tl.load(norm_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(weight * round_to(x * inv_rms, ROUND, dtype), ROUND, dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, delta_ptr, residual_out_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, N, K, eps,
    NORM: tl.constexpr, HAS_DELTA: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    features = program * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < N
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + features[:, None].to(tl.int64) * K + cols[None, :]
    up_ptrs = w_ptr + (features + N)[:, None].to(tl.int64) * K + cols[None, :]  # SwiGLU: after the N gate rows
    first = feature_mask[:, None] & (cols < K)[None, :]
    gate_w = tl.load(gate_ptrs, mask=first, other=0.0, eviction_policy="evict_first")
    if SWIGLU:
        up_w = tl.load(up_ptrs, mask=first, other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)  # activations come from the previous kernel; weights never do
    inv_rms = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for start in range(0, K, BLOCK_K):
            mask = start + cols < K
            row = _input_tile(x_ptr, delta_ptr, start + cols, mask, HAS_DELTA, ROUND, dtype)
            squares += row * row
            if HAS_DELTA:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if program == 0:  # the new residual stream, written once (to the caller's other buffer: no race)
                    tl.store(residual_out_ptr + start + cols, row.to(dtype), mask=mask)
        inv_rms = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    x = _x_tile(x_ptr, delta_ptr, norm_ptr, cols, cols < K, inv_rms, NORM, HAS_DELTA, ROUND, dtype)
    gate_acc = gate_w.to(tl.float32) * x[None, :]
    if SWIGLU:
        up_acc = up_w.to(tl.float32) * x[None, :]
    for start in range(BLOCK_K, K, BLOCK_K):
        mask = start + cols < K
        x = _x_tile(x_ptr, delta_ptr, norm_ptr, start + cols, mask, inv_rms, NORM, HAS_DELTA, ROUND, dtype)
        tile = feature_mask[:, None] & mask[None, :]
        w = tl.load(gate_ptrs + start, mask=tile, other=0.0, eviction_policy="evict_first")
        gate_acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:
            w = tl.load(up_ptrs + start, mask=tile, other=0.0, eviction_policy="evict_first")
            up_acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(gate_acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + features, mask=feature_mask, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.sum(up_acc, axis=1)
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + features, mask=feature_mask, other=0.0).to(tl.float32)
        gate, up = round_to(y, ROUND, dtype), round_to(up, ROUND, dtype)
        y = round_to(gate / (1.0 + tl.exp(-gate)), ROUND, dtype) * up  # as eager's F.silu(gate) * up
    tl.store(out_ptr + features, y.to(dtype), mask=feature_mask)


_gemv_autotuned = triton.autotune(CONFIGS, key=["N", "K", "NORM", "SWIGLU"])(_gemv_kernel)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents (CUDA, compute capability 9+)."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
        and hasattr(tl.extra.cuda, "gdc_wait")
    )


def _launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    swiglu: bool,
    pdl: bool,
    config: triton.Config | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, in_features = x.shape
    if rows != 1 or not weight.is_contiguous() or weight.shape[1] != in_features:
        raise ValueError(
            f"gemv takes one row of x and a contiguous [out, {in_features}] weight, "
            f"got {rows} rows and {tuple(weight.shape)}"
        )
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"SwiGLU needs an even number of outputs (gate then up), got {weight.shape[0]}")
    features = weight.shape[0] // 2 if swiglu else weight.shape[0]
    x = x.contiguous()
    out = torch.empty(1, features, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if delta is not None else None
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    args = (x, x if delta is None else delta, x if residual_out is None else residual_out, norm_weight, weight)
    args += (weight if bias is None else bias, out, features, in_features, eps)
    flags = {
        "NORM": norm is not None,
        "HAS_DELTA": delta is not None,
        "SWIGLU": swiglu,
        "HAS_BIAS": bias is not None,
        "ROUND": x.dtype != torch.float32,
        **launch_flags(pdl),
    }
    if config is None and not x.is_cuda:
        config = triton.Config(INTERPRETER_CONFIG)
    if config is None:
        _gemv_autotuned[lambda meta: (triton.cdiv(features, meta["BLOCK_N"]),)](*args, **flags)
    else:
        meta = config.all_kwargs()
        _gemv_kernel[(triton.cdiv(features, meta["BLOCK_N"]),)](*args, **flags, **meta)
    return out, residual_out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    pdl: bool = False,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x `[1, in]` and a contiguous weight `[out, in]`: `[1, out]`; with
    `swiglu`, `silu(gate) * up` of that output's halves, `[1, out / 2]`.

    `config`: a fixed tile (benchmarks, tests); default: autotuned on CUDA, a small tile under the interpreter."""
    return _launch(x, None, None, weight, bias, swiglu, pdl, config)[0]


def norm_gemv(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    pdl: bool = False,
    config: triton.Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv(RMSNorm(residual + delta), ...)` and the residual stream `residual + delta`, for one row
    `[1, hidden]`. The new residual is a new tensor (every program reads the old one while one writes it);
    without `delta`, it is `residual` itself."""
    out, new_residual = _launch(residual, delta, (norm_weight, eps), weight, bias, swiglu, pdl, config)
    return out, residual if new_residual is None else new_residual
