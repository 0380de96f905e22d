"""SwiGLU over the fused gate/up projection, `silu(gate) * up`, as one Triton kernel forward and one backward.

The MLP computes gate and up as one `[T, 2I]` GEMM. Compiled, the activation's backward becomes one pointwise
kernel over the `[T, 2I]` gradient that picks, column by column, the gate or the up formula (the `cat` of the
two halves), which spends far longer on the activation than separate gate and up projections do (torchtitan's;
the profile is in benchmarks/RESULTS.md). Here each program reads its gate, up and upstream gradient once and
writes both halves of the gradient: the bytes the activation needs and no more.

Numerics are eager PyTorch's for `F.silu(gate) * up` and its autograd: fp32 math, rounded to the activation
dtype where eager rounds (SiLU, the product; `dh * up` and `dh * silu` in the backward, then SiLU's derivative
in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.rounding import round_to

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    gate_up_ptr, grad_ptr, out_ptr, intermediate, BLOCK: tl.constexpr, ROUND: tl.constexpr, BACKWARD: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    dtype = gate_up_ptr.dtype.element_ty
    gate_ptr = gate_up_ptr + row * 2 * intermediate + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + intermediate, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), ROUND, dtype)  # as torch evaluates F.silu
    if BACKWARD:  # out = [d gate, d up], `[T, 2I]`
        grad = tl.load(grad_ptr + row * intermediate + cols, mask=mask, other=0.0).to(tl.float32)
        grad_silu = round_to(grad * up, ROUND, dtype)
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        grad_gate = grad_silu * sigmoid * (1.0 + gate * (1.0 - sigmoid))  # as torch's silu_backward
        out = out_ptr + row * 2 * intermediate + cols
        tl.store(out, grad_gate.to(dtype), mask=mask)
        tl.store(out + intermediate, (grad * silu).to(dtype), mask=mask)
    else:
        tl.store(out_ptr + row * intermediate + cols, (silu * up).to(dtype), mask=mask)


def _launch(gate_up: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """Forward (`grad` None) `[..., I]`, or backward `[..., 2I]`."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"swiglu needs an even last dimension (gate then up), got {width}")
    intermediate, rows = width // 2, gate_up.numel() // width
    gate_up = gate_up.contiguous()
    shape = (*gate_up.shape[:-1], width if grad is not None else intermediate)
    out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK, triton.next_power_of_2(intermediate))
    _swiglu_kernel[(rows, triton.cdiv(intermediate, block))](
        gate_up,
        gate_up if grad is None else grad.contiguous(),
        out,
        intermediate,
        BLOCK=block,
        ROUND=gate_up.dtype != torch.float32,
        BACKWARD=grad is not None,
        enable_fp_fusion=False,
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, `[..., 2I]` -> `[..., I]`, without autograd (the inference engine's decode step)."""
    return _launch(gate_up, None)


@torch.library.custom_op("tandem::swiglu_backward", mutates_args=())
def swiglu_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient `[..., 2I]` of `swiglu` at `gate_up` for the upstream gradient `grad` `[..., I]`."""
    return _launch(gate_up, grad)


@swiglu_backward.register_fake
def _(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


@torch.library.custom_op("tandem::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` `[..., 2I]` (gate columns first, as `GatedMLP` lays them out); `[..., I]`."""
    return silu_mul(gate_up)


@swiglu.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (gate_up,) = ctx.saved_tensors
    return swiglu_backward(gate_up, grad)


swiglu.register_autograd(_backward, setup_context=_setup_context)
