"""DeepSeek-V3: multi-head latent attention; `first_k_dense_replace` dense layers, then MoE layers routed by
group-limited sigmoid scores with a correction bias, plus shared experts.

The multi-token-prediction layers a checkpoint stores after the decoder (`num_nextn_predict_layers`) are not run
and are skipped on load, as transformers does. `parse_moe` is shared with GLM-4.5, which routes the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import MLAArgs, ModelArgs, ModelConfigError, MoEArgs, parse_decoder_args, require

# transformers' DeepseekV3Config defaults for the keys a config.json may leave out
DEFAULTS = {
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "rope_interleave": True,
}


def parse_moe(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> MoEArgs:
    """DeepSeek-V3-style MoE (also GLM-4.5's), with the family's transformers defaults for absent keys."""

    def get(key: str) -> Any:
        return hf.get(key, defaults[key])

    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, supported) != supported:
            raise ModelConfigError(f"{key}={hf[key]!r} is not supported (transformers runs only {supported!r})")
    size = require(hf, "moe_intermediate_size")
    return MoEArgs(
        num_experts=hf.get("n_routed_experts") or require(hf, "num_local_experts"),
        top_k=require(hf, "num_experts_per_tok"),
        intermediate_size=size,
        norm_topk_prob=bool(get("norm_topk_prob")),
        layers=tuple(range(get("first_k_dense_replace"), require(hf, "num_hidden_layers"))),
        scoring="sigmoid",
        score_correction_bias=True,
        n_group=get("n_group"),
        topk_group=get("topk_group"),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        shared_intermediate_size=size * get("n_shared_experts"),
    )


def mtp_layers(hf: Mapping[str, Any]) -> int:
    """How many multi-token-prediction layers checkpoints store after the decoder (transformers' default: 1)."""
    return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)))


def parse(hf: Mapping[str, Any]) -> ModelArgs:
    if hf.get("quantization_config"):
        raise ModelConfigError("quantized checkpoints (e.g. DeepSeek-V3's FP8) are not supported; convert to bf16")
    heads = require(hf, "num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        raise ModelConfigError(f"MLA expands the latent into every head: num_key_value_heads must be {heads}")
    mla = MLAArgs(
        q_lora_rank=hf.get("q_lora_rank", DEFAULTS["q_lora_rank"]),
        kv_lora_rank=require(hf, "kv_lora_rank"),
        qk_nope_head_dim=require(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=require(hf, "qk_rope_head_dim"),
        v_head_dim=require(hf, "v_head_dim"),
        rope_interleave=bool(hf.get("rope_interleave", DEFAULTS["rope_interleave"])),
    )
    return parse_decoder_args(
        hf,
        qk_norm=False,
        moe=parse_moe(hf, DEFAULTS),
        mla=mla,
        num_kv_heads=heads,
        head_dim=mla.qk_head_dim,
        mtp_layers=mtp_layers(hf),
    )


ARCHITECTURE = Architecture("DeepseekV3ForCausalLM", parse)
