"""Tolerances set from the dtype's precision and the values' magnitude instead of by hand, so that a parity check
holds on any CPU or GPU and still fails on a real bug.

Two correct computations of the same values differ by rounding: every op rounds to `eps(dtype)` relative, and a sum
taken in another order (another CPU's SIMD width, a chunked kernel, a fused op) differs by a few ulps of its largest
terms. So the bound is elementwise `|actual - expected| <= k * eps * max|expected|`: `k` counts ulps of the largest
expected value and says how much the computation amplifies rounding. The `K_*` constants are the classes the tests
use, each 4-8x the worst seen (on a 2-core x86 CI-like CPU, torch 2.13, transformers 5.25), so a CPU with another
summation order stays inside, while a bug (a mask, a reset, a rope or a norm wrong, a weight 1% off) moves values
by 1e-2 relative or more, far outside in fp32 (k * eps is at most 1.2e-4, 4.9e-4 for scan gradients).
"""

from __future__ import annotations

import torch

K_REORDERED = 64
"""The same arithmetic split or ordered differently: a KV or state cache against the full forward, a packed
document against the document alone, chunked against unchunked logprobs, one MoE backend against another."""

K_SCAN = 256
"""A chunked recurrent scan (Gated DeltaNet, Mamba-2) against the same scan with chunks starting elsewhere or token
by token (a packed row against its documents alone, a state cache against the full forward): decay products and
the chunk's triangular solve amplify rounding (~60 ulps of the largest logit seen, Qwen3.5)."""

K_REFERENCE = 1024
"""tandem against transformers (or a scan against its token-by-token reference) through a tiny model: different
op decompositions (fused vs separate projections, fp32 norm scaling, expert order, chunked scans) compound
through every layer (~130 ulps of the largest logit seen, Qwen3.5-MoE)."""

K_SCAN_GRADIENT = 4096
"""A gradient through a chunked recurrent scan (Gated DeltaNet, Mamba-2) whose chunks start elsewhere: the decay
products and the chunk's triangular solve amplify rounding most (~600 ulps of the largest gradient seen)."""

TF32_EPS = 2.0**-10
"""TF32's precision (10 explicit mantissa bits): what an fp32 matmul on CUDA rounds to when TF32 is allowed."""

LOOSEST = 0.05
"""No bound may exceed 5% of the largest value: past it a comparison stops telling a bug from rounding."""


def eps(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The relative precision a computation in `dtype` on `device` rounds to: TF32's for fp32 matmuls on CUDA while
    `torch.backends.cuda.matmul.allow_tf32` is on (off by default, and tandem never turns it on)."""
    if dtype == torch.float32 and torch.device(device).type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return TF32_EPS
    return torch.finfo(dtype).eps


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, k: float, *, dtype: torch.dtype | None = None, msg: str = ""
) -> float:
    """Assert `|actual - expected| <= k * eps(dtype) * max|expected|` elementwise (in fp64), both finite and of the
    same shape; `dtype` is the precision the values were computed in (default `actual`'s). Returns the largest
    difference in those ulps (`ulps_apart`)."""
    dtype = dtype or actual.dtype
    precision = eps(dtype, actual.device)
    if k * precision > LOOSEST:
        raise ValueError(
            f"k={k} ulps of {dtype} is {k * precision:.1%} of the largest value: too loose to mean anything"
        )
    ulps = ulps_apart(actual, expected, dtype=dtype, msg=msg)
    if not ulps <= k:
        want = expected.detach().double().cpu()
        bound = k * precision * want.abs().max().item()
        over = int(((actual.detach().double().cpu() - want).abs() > bound).sum())
        raise AssertionError(
            f"{msg + ': ' if msg else ''}max |diff| is {ulps:.0f} ulps of max|expected| {want.abs().max():.3e} in "
            f"{dtype}, over the bound of {k} ulps ({bound:.3e}); {over} of {want.numel()} elements past it"
        )
    return ulps


def ulps_apart(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None, msg: str = ""
) -> float:
    """max|actual - expected| in units of `eps(dtype) * max|expected|` (inf when `expected` is all zeros and
    `actual` is not); both must be finite and of the same shape. A test's sensitivity check uses it to show that
    what a bug would change lands far outside the bound."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    got, want = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(want).all() and torch.isfinite(got).all(), f"{msg}: non-finite values"
    if not want.numel():
        return 0.0
    worst, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not scale:
        return float("inf") if worst else 0.0
    return worst / (eps(dtype or actual.dtype, actual.device) * scale)
