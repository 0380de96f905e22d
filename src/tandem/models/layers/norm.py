"""RMSNorm computed in fp32 and cast back, exactly as Hugging Face does, so logits match bit for bit in fp32.

The output keeps the input's dtype: under autocast (fp32 weights), bf16 q/k stay bf16 through qk-norm as in a
bf16 model, instead of being promoted to fp32 by the weight.

`centered=True` is the zero-centred variant (Qwen3-Next's `Qwen3NextRMSNorm`): the scale is `1 + weight`, applied
in fp32 before the cast back, and the weight is initialised to zeros. `GatedRMSNorm` is the Gated DeltaNet's
output norm: plain weight, then times `silu(gate)`. `fp32_scale=True` (Nemotron-H's `NemotronHRMSNorm`) multiplies
by the weight in fp32 before the cast back. `GroupedGatedRMSNorm` is Mamba-2's output norm (gate first, then a norm
per group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, centered: bool = False, fp32_scale: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if centered else torch.ones(dim))
        self.eps, self.centered, self.fp32_scale = eps, centered, fp32_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.centered:
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.fp32_scale:
            return (self.weight.float() * x).to(dtype)
        return (self.weight * x.to(dtype)).to(dtype)

    def reset_parameters(self) -> None:
        """The identity scale: zeros when centred, ones otherwise."""
        nn.init.zeros_(self.weight) if self.centered else nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", centered" if self.centered else "")


class GatedRMSNorm(RMSNorm):
    """`RMSNorm(x) * silu(gate)`, the gate in fp32 (HF `Qwen3NextRMSNormGated`)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


class GroupedGatedRMSNorm(RMSNorm):
    """Mamba-2's output norm (HF `NemotronHRMSNormGated`, `norm_before_gate=False`): in fp32, `x * silu(gate)`, then
    RMS-normalised within each of `groups` equal slices of the last dim, then scaled by the weight (in the input's
    dtype)."""

    def __init__(self, dim: int, groups: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.groups = groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        x = x.unflatten(-1, (self.groups, -1))
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * x.to(dtype)
