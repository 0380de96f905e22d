"""Nemotron-H (`NemotronHForCausalLM`): a hybrid of Mamba-2, attention and MLP layers, each block one norm and one
mixer with a residual (`decoder.MixerBlock`), as transformers' `modeling_nemotron_h.py`.

- Layers: `layers_block_type` (`linear_attention` = Mamba-2, `full_attention`, `mlp`, `moe`; what transformers 5
  writes), else `hybrid_override_pattern` (`M`, `*`, `-`, `E`; the hub's configs).
- Mamba-2 (`layers.mamba2`): `mamba_num_heads` x `mamba_head_dim`, `ssm_state_size`, `n_groups`, `conv_kernel`,
  `use_conv_bias`, `use_bias` (in/out projections), `time_step_limit`, `chunk_size`; the older `mamba_*` spellings
  (`mamba_n_groups`, `mamba_d_conv`, `mamba_conv_bias`, `mamba_chunk_size`, `mamba_dt_limit`, ...) are read too.
- Attention: GQA without position embedding and without biases (transformers builds q/k/v/o without bias whatever
  `attention_bias` says), `head_dim` (128 when absent).
- MLP: `up_proj`, `mlp_hidden_act` (only `relu2`), `down_proj`, `mlp_bias`.
- MoE (`moe` layers, the one MoE runtime): DeepSeek-V3's routing (`mixer.gate.weight` and
  `e_score_correction_bias`: sigmoid scores, `n_group` / `topk_group`, `norm_topk_prob`, `routed_scaling_factor`)
  over `n_routed_experts` ungated squared-ReLU experts (`mixer.experts.{e}.up_proj` / `down_proj`,
  `moe_intermediate_size`), `num_experts_per_tok` a token, plus an ungated shared expert
  (`mixer.shared_experts.*`, `moe_shared_expert_intermediate_size`). `moe_latent_size` is refused.
- RMSNorms (`layer_norm_epsilon`) scale by the weight in fp32 before the cast back.
- Names on disk: `backbone.embeddings`, `backbone.layers.{i}.norm`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f`,
  `lm_head` (transformers renames `backbone.` to `model.` in memory only). `mtp.*` weights are skipped on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import MambaArgs, ModelArgs, ModelConfigError, MoEArgs, RopeArgs, parse_decoder_args
from .hf_layout import HFLayout

# transformers' NemotronHConfig defaults for keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_limit": (0.0, float("inf")),
    "time_step_floor": 1e-4,
    "use_conv_bias": True,
    "use_bias": False,
    "chunk_size": 128,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
}
LEGACY = {  # older config.json spellings, as NemotronHConfig.__post_init__ reads them
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
KINDS = {
    "M": "mamba",
    "linear_attention": "mamba",
    "mamba": "mamba",
    "*": "full_attention",
    "full_attention": "full_attention",
    "attention": "full_attention",
    "-": "mlp",
    "mlp": "mlp",
    "E": "moe",
    "moe": "moe",
}


def layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
    blocks = hf.get("layers_block_type") or hf.get("layer_types") or list(hf.get("hybrid_override_pattern") or "")
    if not blocks:
        raise ModelConfigError("Nemotron-H config.json needs layers_block_type or hybrid_override_pattern")
    unknown = sorted({b for b in blocks if b not in KINDS})
    if unknown:
        raise ModelConfigError(f"Nemotron-H layer types {unknown} are not supported (known: {sorted(KINDS)})")
    return tuple(KINDS[b] for b in blocks)


def parse_moe(hf: Mapping[str, Any], types: tuple[str, ...]) -> MoEArgs | None:
    """The `moe` layers' experts: DeepSeek-V3's routing (sigmoid scores, a correction bias, group-limited top-k,
    scaled weights) over ungated squared-ReLU experts, plus an ungated shared expert."""
    layers = tuple(i for i, kind in enumerate(types) if kind == "moe")
    if not layers:
        return None
    if hf.get("moe_latent_size") is not None:
        raise ModelConfigError("Nemotron-H moe_latent_size (latent expert projections) is not supported")
    return MoEArgs(
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        layers=layers,
        scoring="sigmoid",
        score_correction_bias=True,
        n_group=hf["n_group"],
        topk_group=hf["topk_group"],
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        shared_intermediate_size=hf["moe_shared_expert_intermediate_size"],
        expert_activation="relu2",
    )


def parse(config: Mapping[str, Any]) -> ModelArgs:
    hf = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    for old, new in LEGACY.items():
        if config.get(old) is not None:
            hf[new] = config[old]
    if hf["mlp_hidden_act"] != "relu2":
        raise ModelConfigError(f"mlp_hidden_act {hf['mlp_hidden_act']!r} is not supported (only 'relu2')")
    if hf["mamba_hidden_act"] != "silu":
        raise ModelConfigError(f"mamba_hidden_act {hf['mamba_hidden_act']!r} is not supported (only 'silu')")
    types = layer_types(hf)
    moe = parse_moe(hf, types)
    low, high = hf["time_step_limit"]
    mamba = MambaArgs(
        num_heads=hf["mamba_num_heads"],
        head_dim=hf["mamba_head_dim"],
        state_size=hf["ssm_state_size"],
        n_groups=hf["n_groups"],
        conv_kernel=hf["conv_kernel"],
        chunk_size=hf["chunk_size"],
        conv_bias=bool(hf["use_conv_bias"]),
        proj_bias=bool(hf["use_bias"]),
        dt_limit=(float(low), float(high)),
        time_step_min=hf["time_step_min"],
        time_step_max=hf["time_step_max"],
        time_step_floor=hf["time_step_floor"],
    )
    hf.pop("hidden_act", None)  # the MLP's activation is mlp_hidden_act
    hf["num_hidden_layers"] = len(types)
    args = parse_decoder_args(
        {**hf, "rms_norm_eps": hf["layer_norm_epsilon"]},
        qk_norm=False,
        mlp_bias=bool(hf["mlp_bias"]),
        rope=RopeArgs(),
        layer_types=types,
        mamba=mamba,
        moe=moe,
        block="mixer",
        rope_free=True,
        mlp_activation="relu2",
        norm_fp32_scale=True,
        attention_bias=False,
        attention_out_bias=False,
    )
    return args.replace(hf_config=dict(config))


ARCHITECTURE = Architecture(
    "NemotronHForCausalLM",
    parse,
    layout=HFLayout(prefix="backbone.", embed_tokens="embeddings", final_norm="norm_f"),
)
