"""What the registry holds for one Hugging Face architecture: how to parse its config and name its weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import ModelArgs
from .decoder import CausalLM
from .runtime import ModelRuntime


@dataclass(frozen=True)
class HFLayout:
    """Hugging Face key templates that differ between families (per layer, after `model.layers.{i}.`)."""

    router: str = "mlp.gate.weight"
    router_bias: str = "mlp.gate.e_score_correction_bias"
    expert: str = "mlp.experts.{expert}.{proj}.weight"
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stacked_gate_up: str = "mlp.experts.gate_up_proj"  # transformers' in-memory stacked layout, if ever on disk
    stacked_down: str = "mlp.experts.down_proj"
    peft_prefix: str = "model."
    """The decoder's module path in transformers' in-memory model, which PEFT adapter keys follow
    (`base_model.model.<peft_prefix>layers...`; vision-language classes: `model.language_model.`)."""
    save_stacked_experts: bool = False
    """Write experts stacked (`stacked_gate_up`, `stacked_down`) rather than one tensor per expert and projection:
    for families whose checkpoints store them so (Qwen3-VL-MoE), which transformers then reads unchanged."""
    shared_experts: str = "mlp.shared_experts."  # prefix of the shared SwiGLU's gate/up/down_proj
    shared_expert_gate: str = "mlp.shared_expert_gate.weight"
    prefix: str = "model."  # before `layers.{i}.`, the embedding and the final norm (Nemotron-H: `backbone.`)
    embed_tokens: str = "embed_tokens"  # the embedding's name under `prefix` (Nemotron-H: `embeddings`)
    final_norm: str = "norm"  # the final norm's name under `prefix` (Nemotron-H: `norm_f`)
    load_renames: tuple[tuple[str, str], ...] = ()
    """(stored prefix, prefix read as) pairs for checkpoints of a wider model whose text decoder this is (Qwen3.5's
    multimodal checkpoints: `model.language_model.` read as `model.`); saving writes the plain names."""
    load_skips: tuple[str, ...] = ()
    """Prefixes of stored tensors tandem does not run and skips on load (a vision tower: `model.visual.`)."""


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # `architectures[0]` in config.json
    parse: Callable[[Mapping[str, Any]], ModelArgs]
    model_cls: Callable[[ModelArgs, ModelRuntime], nn.Module] = CausalLM
    layout: HFLayout = field(default_factory=HFLayout)
