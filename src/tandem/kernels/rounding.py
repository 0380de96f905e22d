"""Rounding shared by the kernels that reproduce eager PyTorch's numerics in a low-precision dtype."""

import triton
import triton.language as tl


@triton.jit
def round_to(value, ROUND: tl.constexpr, dtype: tl.constexpr):
    """Round fp32 `value` to `dtype` (nearest even) and back, as an eager op in `dtype` would; fp32: as is."""
    if ROUND:
        value = value.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    return value
