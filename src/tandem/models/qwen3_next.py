"""Qwen3-Next (`Qwen3NextForCausalLM`): a hybrid of Gated DeltaNet (`linear_attention`) and gated full-attention
layers, with a sparse MoE whose shared expert is gated per token.

- Layers: `layer_types`, else every `full_attention_interval`-th layer (default 4) is full attention.
- Linear layers: `layers.gated_deltanet` with `linear_num_key_heads`, `linear_num_value_heads`,
  `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`.
- Full attention: GQA with qk-norm, RoPE on the leading `partial_rotary_factor` (0.25 when absent, as transformers
  assumes) of each `head_dim` (256 when absent), the output multiplied by `sigmoid(gate)` from `q_proj`.
- RMSNorms are zero-centred (scale `1 + weight`), except the Gated DeltaNet's gated output norm.
- MLP: softmax-routed MoE on every `decoder_sparse_step`-th layer not in `mlp_only_layers` (dense if
  `num_experts` is 0), plus a shared expert (`mlp.shared_expert.*`) scaled by `sigmoid(mlp.shared_expert_gate(x))`.

The multi-token-prediction weights checkpoints store under `mtp.*` are not run and are skipped on load, as
transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import LinearAttnArgs, ModelArgs, ModelConfigError, MoEArgs, parse_decoder_args, parse_rope
from .hf_layout import HFLayout

# transformers' Qwen3NextConfig defaults for keys a config.json may leave out
DEFAULTS = {
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "full_attention_interval": 4,
}
PARTIAL_ROTARY_FACTOR = 0.25


def layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
    layers = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = hf["full_attention_interval"]
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


def parse_moe(hf: Mapping[str, Any]) -> MoEArgs | None:
    if not hf["num_experts"]:
        return None
    step, dense = hf["decoder_sparse_step"], set(hf.get("mlp_only_layers") or ())
    return MoEArgs(
        num_experts=hf["num_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        layers=tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0),
        shared_intermediate_size=hf["shared_expert_intermediate_size"],
        shared_expert_gate=True,
    )


def parse(config: Mapping[str, Any]) -> ModelArgs:
    hf = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if "num_hidden_layers" not in hf:
        raise ModelConfigError(f"config.json for {hf.get('architectures')} is missing required key 'num_hidden_layers'")
    linear = LinearAttnArgs(
        num_k_heads=hf["linear_num_key_heads"],
        num_v_heads=hf["linear_num_value_heads"],
        k_head_dim=hf["linear_key_head_dim"],
        v_head_dim=hf["linear_value_head_dim"],
        conv_kernel=hf["linear_conv_kernel_dim"],
    )
    args = parse_decoder_args(
        hf,
        qk_norm=True,
        moe=parse_moe(hf),
        rope=parse_rope(hf, partial_rotary_factor=PARTIAL_ROTARY_FACTOR),
        layer_types=layer_types(hf),
        linear=linear,
        attn_output_gate=True,
        zero_centered_norm=True,
    )
    return args.replace(hf_config=dict(config))


ARCHITECTURE = Architecture(
    "Qwen3NextForCausalLM",
    parse,
    layout=HFLayout(shared_experts="shared_expert."),
)
