"""Dense SwiGLU MLP with gate and up fused into one matmul (`gate_up_proj` rows: gate first, then up), and the
ungated MLP (`up_proj`, activation, `down_proj`) of Nemotron-H's `mlp` layers (squared ReLU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..hf_layout import Fused, WeightMap, param_kinds, plain, same_names
from ..runtime import ModelRuntime


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for the fused projection's output `[..., 2I]`; `[..., I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# `swiglu_backend` names. Kernels (tandem.kernels.swiglu) are registered by their user, since this package
# imports nothing else of tandem.
SWIGLU_BACKENDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": swiglu}


class GatedMLP(nn.Module):
    """`down_proj(silu(gate) * up)` with `gate_up_proj` fused; the decoder's dense MLP and a MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "torch") -> None:
        super().__init__()
        if activation not in SWIGLU_BACKENDS:
            raise ValueError(f"unknown swiglu_backend {activation!r}; known: {sorted(SWIGLU_BACKENDS)}")
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(SWIGLU_BACKENDS[self.activation](self.gate_up_proj(x)))

    @staticmethod
    def hf_weights(intermediate_size: int, bias: bool) -> WeightMap:
        """HF's `gate_proj` and `up_proj` fused into `gate_up_proj` (gate rows first); `down_proj`."""
        out = {}
        for kind in param_kinds(bias):
            gate_up = (f"gate_proj.{kind}", f"up_proj.{kind}")
            out[f"gate_up_proj.{kind}"] = Fused((gate_up,), (intermediate_size, intermediate_size))
            out[f"down_proj.{kind}"] = plain(f"down_proj.{kind}")
        return out


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

    @staticmethod
    def mixer(args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> MLP:
        """Nemotron-H's `mlp` layers: `intermediate_size`, `mlp_bias`, `mlp_activation`."""
        return MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias, activation=args.mlp_activation)

    @staticmethod
    def hf_weights(bias: bool) -> WeightMap:
        """`up_proj`, `down_proj` under HF's names."""
        return same_names(*(f"{p}_proj.{kind}" for p in ("up", "down") for kind in param_kinds(bias)))
