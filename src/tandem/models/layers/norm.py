"""RMSNorm computed in fp32 and cast back, exactly as Hugging Face does, so logits match bit for bit in fp32.

The output keeps the input's dtype: under autocast (fp32 weights), bf16 q/k stay bf16 through qk-norm as in a
bf16 model, instead of being promoted to fp32 by the weight.

`centered=True` is the zero-centred variant (Qwen3-Next's `Qwen3NextRMSNorm`): the scale is `1 + weight`, applied
in fp32 before the cast back, and the weight is initialised to zeros. `GatedRMSNorm` is the Gated DeltaNet's
output norm: plain weight, then times `silu(gate)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if centered else torch.ones(dim))
        self.eps, self.centered = eps, centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.centered:
            return (x * (1.0 + self.weight.float())).to(dtype)
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
