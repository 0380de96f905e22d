"""RMSNorm computed in fp32 and cast back, exactly as Hugging Face does, so logits match bit for bit in fp32.

The output keeps the input's dtype: under autocast (fp32 weights), bf16 q/k stay bf16 through qk-norm as in a
bf16 model, instead of being promoted to fp32 by the weight.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype)).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
