"""Dense SwiGLU MLP with gate and up fused into one matmul (`gate_up_proj` rows: gate first, then up), and the
ungated MLP (`up_proj`, activation, `down_proj`) of Nemotron-H's `mlp` layers (squared ReLU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for the fused projection's output `[..., 2I]`; `[..., I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# `swiglu_backend` names. Kernels (tandem.kernels.swiglu) are registered by their user, since this package
# imports nothing else of tandem.
SWIGLU_BACKENDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": swiglu}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "torch") -> None:
        super().__init__()
        if activation not in SWIGLU_BACKENDS:
            raise ValueError(f"unknown swiglu_backend {activation!r}; known: {sorted(SWIGLU_BACKENDS)}")
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(SWIGLU_BACKENDS[self.activation](self.gate_up_proj(x)))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu2": lambda x: F.relu(x).square()}
"""Activations of the ungated `MLP` (HF `mlp_hidden_act` names)."""


class MLP(nn.Module):
    """`down_proj(act(up_proj(x)))`. Also a token mixer of one-mixer blocks: extra arguments are ignored."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "relu2") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {activation!r}; known: {sorted(ACTIVATIONS)}")
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor, *_: object) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.up_proj(x)))
