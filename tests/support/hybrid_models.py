"""A tiny servable hybrid model (Qwen3-Next: Gated DeltaNet layers with a recurrent state beside gated attention),
for the engine and RL tests."""

from __future__ import annotations

from pathlib import Path

from support.model_parity import write_hf_model
from tandem.testing.tiny import SPECIAL_TOKENS, write_tokenizer

QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 72,
    "intermediate_size": 88,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 10,
    "linear_value_head_dim": 14,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
"""Tiny Qwen3-Next (as tests/models/test_qwen3_next.py): layers linear, full, linear, full; 2 key heads serving 6
value heads (k dim 10, v dim 14); GQA 6/2, head dim 12, partial rotary."""

QWEN3_5 = {
    **{
        k: v
        for k, v in QWEN3_NEXT.items()
        if "expert" not in k and k not in ("moe_intermediate_size", "norm_topk_prob", "mlp_only_layers")
    },
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
}
"""Tiny Qwen3.5 text model: QWEN3_NEXT's layers and heads with a dense MLP (the Gated DeltaNet's projections are
stored apart)."""

QWEN3_5_MOE = {
    **{k: v for k, v in QWEN3_NEXT.items() if k not in ("norm_topk_prob", "mlp_only_layers")},
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
}
"""Tiny Qwen3.5-MoE text model: QWEN3_NEXT's MoE on every layer (Qwen3.5-MoE has no dense layers option)."""

NEMOTRON_H_MOE = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 48,
    "hybrid_override_pattern": "M*E-M",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "intermediate_size": 40,
    "mamba_num_heads": 4,
    "mamba_head_dim": 12,
    "ssm_state_size": 8,
    "n_groups": 2,
    "chunk_size": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 24,
    "routed_scaling_factor": 2.0,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
"""Tiny Nemotron-H with a MoE block: Mamba-2, attention, MoE (4 ungated experts, top 2, a shared expert), MLP,
Mamba-2."""

PERTURB = ("layernorm.weight", "norm.weight", "dt_bias", "A_log")
"""Zero-centred norms start at 0 and dt_bias at 1 in transformers: randomised so that parity covers them."""


def write_servable_hybrid(path: Path, config: dict = QWEN3_NEXT, seed: int = 0) -> Path:
    """`support.model_parity.write_servable_model` for a hybrid config (QWEN3_NEXT, QWEN3_5), its zero-initialised
    norms and gates perturbed."""
    vocab = write_tokenizer(path)
    special = {"bos_token_id": None, "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"), "pad_token_id": 0}
    return write_hf_model(path, {**config, "vocab_size": vocab, **special}, seed, perturb=PERTURB)
