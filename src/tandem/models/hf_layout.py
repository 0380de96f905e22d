"""How runtime tensors are named and laid out in Hugging Face checkpoints: `Fused`, the per-family `HFLayout`, and
the helpers every module's weight map is written with.

A weight map (`WeightMap`) sends each runtime parameter name to the HF tensors it is made of. Each module states
its own, with names relative to itself (`Attention.hf_weights`: `qkv_proj.weight` <- `q_proj.weight`, ...); the
decoder nests them under the block and layer (`nest`), and `checkpoint.py` reads and writes through the result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Fused:
    """One runtime tensor from HF tensors: each group in `parts` is concatenated on dim 0 (`sizes` rows each,
    when there are several); the groups are stacked on a new dim 0 when `stacked` (experts)."""

    parts: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...] | None = None
    stacked: bool = False

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return tuple(k for group in self.parts for k in group)

    def under(self, prefix: str) -> Fused:
        """These tensors with `prefix` before every HF key."""
        return dataclasses.replace(self, parts=tuple(tuple(prefix + k for k in group) for group in self.parts))


WeightMap = dict[str, Fused]
"""Runtime parameter name -> the HF tensors it is built from."""


def plain(key: str) -> Fused:
    """A runtime tensor that is one HF tensor, unchanged."""
    return Fused(((key,),))


def same_names(*names: str) -> WeightMap:
    """Runtime tensors stored under their own names (HF's), unchanged."""
    return {name: plain(name) for name in names}


def param_kinds(bias: bool) -> tuple[str, ...]:
    """A linear layer's parameters: `weight`, and `bias` when it has one."""
    return ("weight", "bias") if bias else ("weight",)


def nest(prefix: str, weights: WeightMap, hf_prefix: str | None = None) -> WeightMap:
    """`weights` of a submodule at `prefix`: runtime names get `prefix`, HF keys `hf_prefix` (default the same)."""
    hf = prefix if hf_prefix is None else hf_prefix
    return {prefix + name: fused.under(hf) for name, fused in weights.items()}


@dataclass(frozen=True)
class HFLayout:
    """Hugging Face names that differ between families: the top-level names, a MoE's names (relative to the MoE
    module, `mlp.` or Nemotron-H's `mixer.`), and where a wider checkpoint keeps the text decoder."""

    router: str = "gate.weight"
    router_bias: str = "gate.e_score_correction_bias"
    expert: str = "experts.{expert}.{proj}.weight"
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stacked_gate_up: str = "experts.gate_up_proj"  # transformers' in-memory stacked layout, if ever on disk
    stacked_down: str = "experts.down_proj"
    stacked_experts: bool = False
    """Experts are stored stacked (`stacked_gate_up`, `stacked_down`) rather than one tensor per expert and
    projection: saving writes them so for families whose checkpoints store them so (Qwen3-VL-MoE), which
    transformers then reads unchanged; a load that finds them stacked reads them so."""
    shared_experts: str = "shared_experts."  # prefix of the shared expert's gate/up/down_proj (Qwen3-Next: singular)
    shared_expert_gate: str = "shared_expert_gate.weight"
    peft_prefix: str = "model."
    """The decoder's module path in transformers' in-memory model, which PEFT adapter keys follow
    (`base_model.model.<peft_prefix>layers...`; vision-language classes: `model.language_model.`)."""
    prefix: str = "model."  # before `layers.{i}.`, the embedding and the final norm (Nemotron-H: `backbone.`)
    embed_tokens: str = "embed_tokens"  # the embedding's name under `prefix` (Nemotron-H: `embeddings`)
    final_norm: str = "norm"  # the final norm's name under `prefix` (Nemotron-H: `norm_f`)
    load_renames: tuple[tuple[str, str], ...] = ()
    """(stored prefix, prefix read as) pairs for checkpoints of a wider model whose text decoder this is (Qwen3.5's
    multimodal checkpoints: `model.language_model.` read as `model.`); saving writes the plain names."""
    load_skips: tuple[str, ...] = ()
    """Prefixes of stored tensors tandem does not run and skips on load (a vision tower: `model.visual.`)."""
