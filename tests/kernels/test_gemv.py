"""The batch-1 GEMV equals plain torch: `F.linear`, with the residual add + RMSNorm before it and SwiGLU after.

On CPU it runs under Triton's interpreter (fp32); on CUDA compiled, in fp32 and bf16, autotuned, per tile
and launched as a programmatic dependent (Hopper).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton GEMV needs the triton package (CPU wheels of torch lack it)")

from tandem.kernels.gemv import CONFIGS, gemv, norm_gemv, pdl_supported
from tandem.models.layers.mlp import swiglu
from tandem.models.layers.norm import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
SHAPES = [(38, 100), (64, 2048), (130, 3000)]  # ragged tiles; an input past one tile


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _launches() -> list[dict]:
    """Every way the kernel runs here: the interpreter's tile; on CUDA autotuned, each tile, and with PDL."""
    if DEVICE == "cpu":
        return [{}]
    return [{}, *({"config": c} for c in CONFIGS), *([{"pdl": True}] if pdl_supported(torch.device(DEVICE)) else [])]


def _inputs(out_features: int, in_features: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(out_features)
    x, delta = (torch.randn(1, in_features, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(out_features, in_features, generator=g).to(DEVICE, dtype) * 0.05
    b = torch.randn(out_features, generator=g).to(DEVICE, dtype) if bias else None
    norm = (1 + 0.1 * torch.randn(in_features, generator=g)).to(DEVICE, dtype)
    return x, delta, weight, b, norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["none", "swiglu"])
def test_gemv_matches_linear(dtype, out_features, in_features, bias, activation):
    x, _, weight, b, _ = _inputs(out_features, in_features, dtype, bias)
    want = F.linear(x, weight, b)
    if activation == "swiglu":
        want = swiglu(want)
    for launch in _launches():
        got = gemv(x, weight, b, swiglu=activation == "swiglu", **launch)
        torch.testing.assert_close(got, want, **_tolerance(dtype), msg=lambda m, launch=launch: f"{launch}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_norm_gemv_matches_add_rms_norm_then_linear(dtype, out_features, in_features, with_delta):
    residual, delta, weight, b, norm = _inputs(out_features, in_features, dtype, bias=True)
    new_residual = residual + delta if with_delta else residual
    rms_norm = RMSNorm(in_features, eps=1e-6).to(DEVICE, dtype)
    rms_norm.weight.data.copy_(norm)
    want = swiglu(F.linear(rms_norm(new_residual), weight, b))  # the model's RMSNorm, rounded where it rounds
    for launch in _launches():
        got, got_residual = norm_gemv(
            residual, delta if with_delta else None, norm, 1e-6, weight, b, swiglu=True, **launch
        )
        torch.testing.assert_close(got, want, **_tolerance(dtype), msg=lambda m, launch=launch: f"{launch}: {m}")
        torch.testing.assert_close(got_residual, new_residual, atol=0, rtol=0)  # the eager add, rounded once


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(1, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="even number"):
        gemv(torch.randn(1, 8, device=DEVICE), torch.randn(5, 8, device=DEVICE), swiglu=True)
