"""GLM-4.5 (`Glm4MoeForCausalLM`): GQA with biased q/k/v (never o_proj), optional qk-norm (`use_qk_norm`), RoPE on
the leading `partial_rotary_factor` of each head (0.5 when absent, as transformers assumes), and DeepSeek-V3's
MoE (`deepseek_v3.parse_moe`) after `first_k_dense_replace` dense layers.

The multi-token-prediction layers checkpoints store after the decoder (`num_nextn_predict_layers`) are not run
and are skipped on load, as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import ModelArgs, parse_decoder_args, parse_rope
from .deepseek_v3 import mtp_layers, parse_moe

# transformers' Glm4MoeConfig defaults for the keys a config.json may leave out
DEFAULTS = {
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
}
PARTIAL_ROTARY_FACTOR = 0.5


def parse(hf: Mapping[str, Any]) -> ModelArgs:
    return parse_decoder_args(
        hf,
        qk_norm=bool(hf.get("use_qk_norm", False)),
        moe=parse_moe(hf, DEFAULTS),
        rope=parse_rope(hf, partial_rotary_factor=PARTIAL_ROTARY_FACTOR),
        attention_out_bias=False,
        mtp_layers=mtp_layers(hf),
    )


ARCHITECTURE = Architecture("Glm4MoeForCausalLM", parse)
