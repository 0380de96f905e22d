"""Qwen3.5 text models (`Qwen3_5ForCausalLM`, and the text decoder of `Qwen3_5ForConditionalGeneration`): Qwen3-Next's
hybrid of Gated DeltaNet and gated full-attention layers (`qwen3_next`) with a dense MLP.

Differences from Qwen3-Next:
- The Gated DeltaNet's input projections are stored separately (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
  `in_proj_a`), q, k and v of all heads in turn; the runtime concatenates them (`LinearAttnArgs.flat_projections`).
- The MLP is a dense SwiGLU on every layer.
- RoPE is M-RoPE (`mrope_section`). For text every token has the same position on its three axes, so it is plain
  RoPE on the leading `partial_rotary_factor` of each head, which is what runs here.

The released checkpoints are `Qwen3_5ForConditionalGeneration`: the config nests the decoder's `text_config` and the
weights sit under `model.language_model.`, beside a vision tower (`model.visual.*`) and `mtp.*` weights. tandem
loads the text decoder from them (the vision tower and MTP are skipped) and saves what it trains as a
`Qwen3_5ForCausalLM` text checkpoint, which `transformers.AutoModelForCausalLM` loads. Images need the vision
tower, which tandem does not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import qwen3_next
from .architecture import Architecture, HFLayout
from .config import ModelArgs, ModelConfigError

TEXT_ARCHITECTURE = "Qwen3_5ForCausalLM"


def parse(config: Mapping[str, Any]) -> ModelArgs:
    """A `Qwen3_5ForCausalLM` config (`model_type` qwen3_5_text)."""
    args = qwen3_next.parse({**config, "num_experts": 0})  # Qwen3-Next's defaults and layers, a dense MLP
    assert args.linear is not None
    linear = dataclasses.replace(args.linear, flat_projections=True)
    return args.replace(linear=linear, hf_config=dict(config))


def parse_multimodal(config: Mapping[str, Any]) -> ModelArgs:
    """The text decoder of a `Qwen3_5ForConditionalGeneration` config, as the `Qwen3_5ForCausalLM` it saves as."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelConfigError("config.json for Qwen3_5ForConditionalGeneration has no text_config")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return parse(
        {**text, "architectures": [TEXT_ARCHITECTURE], "model_type": "qwen3_5_text", "tie_word_embeddings": tied}
    )


ARCHITECTURE = Architecture(
    TEXT_ARCHITECTURE,
    parse,
    layout=HFLayout(load_renames=(("model.language_model.", "model."),), load_skips=("model.visual.",)),
)
MULTIMODAL_ARCHITECTURE = Architecture("Qwen3_5ForConditionalGeneration", parse_multimodal)
