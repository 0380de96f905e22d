"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 text decoder with a vision tower
(`layers.qwen2_5_vision`).

The text decoder is Qwen2's: GQA with biases on q, k and v (not on `o_proj`), no q/k norm, SwiGLU, and M-RoPE with
each head's frequencies in three blocks (`mrope_section`, time then height then width; not interleaved as
Qwen3-VL's). Image positions follow the same rule as Qwen3-VL's for still images (`layers.rope.mrope_positions`).
The tower has no DeepStack features: its merged patches replace the `image_token_id` placeholders and that is all.

Checkpoints come in two layouts and both load: the hub's (a flat config with `rope_scaling = {"type": "mrope",
...}`, weights under `model.` and `visual.`) and transformers 5's (`text_config`, weights under
`model.language_model.` and `model.visual.`). tandem saves under `model.` and `model.visual.`, which transformers
reads either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import ModelArgs, ModelConfigError, parse_decoder_args
from .hf_layout import HFLayout

LAYOUT = HFLayout(
    load_renames=(("model.language_model.", "model."), ("visual.", "model.visual.")),
    peft_prefix="model.language_model.",
)


def parse(config: Mapping[str, Any]) -> ModelArgs:
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ModelConfigError(f"config.json for {config.get('architectures')} needs a vision_config")
    text = config.get("text_config") or config  # transformers 5 nests it; the hub's files are flat
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {})
    if "mrope_section" not in rope:
        raise ModelConfigError("Qwen2.5-VL needs rope mrope_section (three frequency counts: time, height, width)")
    rope["rope_type"] = "default"  # the hub's "mrope" is the default frequencies, split over the three axes
    rope.pop("type", None)
    rope.setdefault("rope_theta", text.get("rope_theta", config.get("rope_theta", 1000000.0)))
    rope["mrope_interleaved"] = False
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    decoder = {**text, "architectures": config["architectures"], "tie_word_embeddings": tied, "rope_parameters": rope}
    decoder.pop("rope_scaling", None)
    args = parse_decoder_args(decoder, qk_norm=False, attention_bias=True, attention_out_bias=False)
    return args.replace(
        vision_config=dict(vision),
        vision_tower="qwen2_5_vl",
        image_token_id=config.get("image_token_id", 151655),
        hf_config=dict(config),
    )


ARCHITECTURE = Architecture("Qwen2_5_VLForConditionalGeneration", parse, layout=LAYOUT)
