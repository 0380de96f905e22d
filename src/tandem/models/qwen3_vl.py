"""Qwen3-VL (`Qwen3VLForConditionalGeneration`, and `Qwen3VLMoeForConditionalGeneration`): a Qwen3 text decoder,
dense or Qwen3-MoE's, with a vision tower (`layers.vision`).

The text decoder is Qwen3's (GQA with q/k RMSNorm, SwiGLU) with M-RoPE: positions on three axes (time, height,
width), its head's frequencies taken from the axes in turn (`mrope_interleaved`, `mrope_section` frequencies per
axis, `[24, 20, 20]` when the config leaves it out, as transformers does). The vision tower turns an image's
patches into one embedding per 2 x 2 merged patch, which replaces one `image_token_id` placeholder each, and
DeepStack features that are added to the hidden states of those positions after the first decoder layers
(`decoder.CausalLM.hidden_states`).

On disk the decoder sits under `model.language_model.`, the tower under `model.visual.`, the LM head at
`lm_head`; tandem loads and saves them under those names, so a checkpoint it writes is the multimodal one again.
The MoE variant's router always renormalises its top-k weights (no `norm_topk_prob` key) and its experts are
stored stacked, as transformers 5 writes them (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`).
Not run yet: videos (`video_token_id`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import qwen3, qwen3_moe
from .architecture import Architecture
from .config import ModelArgs, ModelConfigError
from .hf_layout import HFLayout

LAYOUT = HFLayout(prefix="model.language_model.", peft_prefix="model.language_model.")
DEFAULT_MROPE_SECTION = (24, 20, 20)


def _parser(decoder_parse: Callable[[Mapping[str, Any]], ModelArgs], **text_defaults: Any):
    """The parser of a Qwen3-VL config whose `text_config` `decoder_parse` reads."""

    def parse(config: Mapping[str, Any]) -> ModelArgs:
        text, vision = config.get("text_config"), config.get("vision_config")
        if not isinstance(text, Mapping) or not isinstance(vision, Mapping):
            raise ModelConfigError(f"config.json for {config.get('architectures')} needs text_config and vision_config")
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {"rope_theta": text.get("rope_theta")})
        rope.setdefault("mrope_section", list(DEFAULT_MROPE_SECTION))
        rope["mrope_interleaved"] = True
        decoder = {**text, **text_defaults, "architectures": config["architectures"], "tie_word_embeddings": tied,
                   "rope_parameters": rope}  # fmt: skip
        return decoder_parse(decoder).replace(
            vision_config=dict(vision),
            vision_tower="qwen3_vl",
            image_token_id=config.get("image_token_id", 151655),
            hf_config=dict(config),
        )

    return parse


ARCHITECTURE = Architecture("Qwen3VLForConditionalGeneration", _parser(qwen3.parse), layout=LAYOUT)
MOE_ARCHITECTURE = Architecture(
    "Qwen3VLMoeForConditionalGeneration",
    _parser(qwen3_moe.parse, norm_topk_prob=True),
    layout=HFLayout(prefix="model.language_model.", peft_prefix="model.language_model.", stacked_experts=True),
)
