"""Rotary embedding as one Triton kernel per tensor, bit for bit equal to the plain-torch rotation.

The reference is `tandem.models.layers.rope.apply_rope`: `x * cos + rotate_half(x) * sin`, evaluated op by op
in the activation dtype, which is what the inference engine runs. Eagerly that is six kernels per tensor
(chunk, neg, cat, two products, sum); here it is one pass that reads x, cos and sin once. To match the
reference exactly, every product and the sum are computed in fp32 and rounded to the activation dtype where
eager PyTorch rounds (after each product, after the sum), and fp32 multiply-add contraction is turned off.
Under `torch.compile` the op stays opaque, so a compiled trainer rotates exactly like an eager engine.

The backward is the same kernel with the rotation transposed (`BACKWARD`), again rounding where eager
autograd of the reference rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.rounding import round_to

BLOCK_HEADS = 4


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    seq_len,
    num_heads,
    x_stride_b,
    x_stride_s,
    x_stride_h,
    cs_stride_b,
    cs_stride_s,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    token = tl.program_id(0)
    b, s = token // seq_len, token % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < num_heads
    x_row = x_ptr + b * x_stride_b + s * x_stride_s + heads[:, None] * x_stride_h + dims[None, :]
    cs_row = b * cs_stride_b + s * cs_stride_s + dims
    lo = tl.load(x_row, mask=mask).to(tl.float32)
    hi = tl.load(x_row + HALF, mask=mask).to(tl.float32)
    cos_lo = tl.load(cos_ptr + cs_row).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + cs_row + HALF).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_ptr + cs_row).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + cs_row + HALF).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if BACKWARD:
        # d lo = g_lo * cos_lo + g_hi * sin_hi,  d hi = g_hi * cos_hi - g_lo * sin_lo
        a_lo, b_lo, a_hi, b_hi = lo * cos_lo, hi * sin_hi, hi * cos_hi, -(lo * sin_lo)
    else:
        # out lo = x_lo * cos_lo - x_hi * sin_lo,  out hi = x_hi * cos_hi + x_lo * sin_hi
        a_lo, b_lo, a_hi, b_hi = lo * cos_lo, -(hi * sin_lo), hi * cos_hi, lo * sin_hi
    # eager rounds each product, then the sum, to the activation dtype (nearest even)
    a_lo, b_lo = round_to(a_lo, ROUND, dtype), round_to(b_lo, ROUND, dtype)
    a_hi, b_hi = round_to(a_hi, ROUND, dtype), round_to(b_hi, ROUND, dtype)
    out_lo, out_hi = round_to(a_lo + b_lo, ROUND, dtype), round_to(a_hi + b_hi, ROUND, dtype)
    out_row = out_ptr + token * num_heads * 2 * HALF + heads[:, None] * 2 * HALF + dims[None, :]
    tl.store(out_row, out_lo.to(dtype), mask=mask)
    tl.store(out_row + HALF, out_hi.to(dtype), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """Rotate `x` `[B, S, H, D]` (last dim contiguous) by cos/sin `[B or 1, S, D]`; a new contiguous tensor."""
    batch, seq, heads, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope kernel needs a contiguous last dimension and cos/sin of the same layout")
    if dim % 2 or dim & (dim - 1):
        raise ValueError(f"rope kernel needs a power-of-two head_dim, got {dim}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos_stride_b = cos.stride(0) if cos.shape[0] > 1 else 0
    grid = (batch * seq, -(-heads // BLOCK_HEADS))
    _rope_kernel[grid](
        x,
        out,
        cos,
        sin,
        seq,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        cos_stride_b,
        cos.stride(1),
        HALF=dim // 2,
        BLOCK_H=BLOCK_HEADS,
        ROUND=x.dtype != torch.float32,
        BACKWARD=backward,
        enable_fp_fusion=False,
    )
    return out


@torch.library.custom_op("tandem::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for x `[B, S, H, D]`, cos/sin `[B or 1, S, D]` of x's dtype."""
    return _launch(x, cos, sin, backward)


@rope.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup_context(ctx, inputs, output) -> None:
    _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(ctx, grad: torch.Tensor):
    cos, sin = ctx.saved_tensors
    return rope(grad.contiguous(), cos, sin, not ctx.backward), None, None, None


rope.register_autograd(_backward, setup_context=_setup_context)


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `apply_rope`: q `[B, S, Hq, D]`, k `[B, S, Hkv, D]`, cos/sin `[B, S, D]`."""
    return rope(q, cos, sin), rope(k, cos, sin)
