"""Qwen3.5 text models (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the text decoder of the
`...ForConditionalGeneration` checkpoints): Qwen3-Next's hybrid of Gated DeltaNet and gated full-attention layers
(`qwen3_next`), with a dense MLP or Qwen3-Next's MoE.

Differences from Qwen3-Next:
- The Gated DeltaNet's input projections are stored separately (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
  `in_proj_a`), q, k and v of all heads in turn; the runtime concatenates them (`LinearAttnArgs.flat_projections`).
- The MLP is a dense SwiGLU on every layer (Qwen3.5), or Qwen3-Next's MoE with its top-k always renormalised
  (Qwen3.5-MoE, which has no `norm_topk_prob`).
- RoPE is M-RoPE (`mrope_section`). For text every token has the same position on its three axes, so it is plain
  RoPE on the leading `partial_rotary_factor` of each head, which is what runs here.

The released checkpoints are `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`: the config
nests the decoder's `text_config` and the weights sit under `model.language_model.`, beside a vision tower
(`model.visual.*`) and `mtp.*` weights. tandem loads the text decoder from them (the vision tower and MTP are
skipped) and saves what it trains as a `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` text checkpoint, which
`transformers.AutoModelForCausalLM` loads. Images need the vision tower, which tandem does not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from . import qwen3_next
from .architecture import Architecture
from .config import ModelArgs, ModelConfigError
from .hf_layout import HFLayout

LAYOUT = HFLayout(
    shared_experts="shared_expert.",
    load_renames=(("model.language_model.", "model."),),
    load_skips=("model.visual.",),
)
"""Qwen3-Next's names (MoE: `mlp.shared_expert.*`, `mlp.shared_expert_gate`), read from a multimodal checkpoint's
`model.language_model.*` too."""


def parse(config: Mapping[str, Any]) -> ModelArgs:
    """A `Qwen3_5ForCausalLM` config (`model_type` qwen3_5_text): a dense MLP."""
    return _hybrid(config, {"num_experts": 0})


def parse_moe(config: Mapping[str, Any]) -> ModelArgs:
    """A `Qwen3_5MoeForCausalLM` config: Qwen3-Next's MoE (a gated shared expert), top-k always renormalised."""
    return _hybrid(config, {"norm_topk_prob": True})


def _hybrid(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> ModelArgs:
    args = qwen3_next.parse({**config, **overrides})  # Qwen3-Next's defaults, layers and MoE
    assert args.linear is not None
    return args.replace(linear=dataclasses.replace(args.linear, flat_projections=True), hf_config=dict(config))


def _text_decoder(text_architecture: Architecture, model_type: str) -> Callable[[Mapping[str, Any]], ModelArgs]:
    """The parser of a multimodal config: its `text_config`, as the text model it saves as."""

    def parse_multimodal(config: Mapping[str, Any]) -> ModelArgs:
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelConfigError(f"config.json for {config.get('architectures')} has no text_config")
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        name = text_architecture.hf_name
        return text_architecture.parse(
            {**text, "architectures": [name], "model_type": model_type, "tie_word_embeddings": tied}
        )

    return parse_multimodal


ARCHITECTURE = Architecture("Qwen3_5ForCausalLM", parse, layout=LAYOUT)
MOE_ARCHITECTURE = Architecture("Qwen3_5MoeForCausalLM", parse_moe, layout=LAYOUT)
MULTIMODAL_ARCHITECTURES = (
    Architecture("Qwen3_5ForConditionalGeneration", _text_decoder(ARCHITECTURE, "qwen3_5_text")),
    Architecture("Qwen3_5MoeForConditionalGeneration", _text_decoder(MOE_ARCHITECTURE, "qwen3_5_moe_text")),
)
