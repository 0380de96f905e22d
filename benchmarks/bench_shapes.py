"""The model shapes of benchmarks/sft_throughput.py, once, for both trainers.

`hf_config` gives the Hugging Face config.json tandem builds from; benchmarks/titan_spec.py turns the same
entries into torchtitan's Qwen3ModelArgs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0  # 0: dense
    top_k: int = 0
    expert_intermediate: int = 0
    rope_theta: float = 1e6

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def hf_config(self) -> dict:
        config = {
            "architectures": ["Qwen3MoeForCausalLM" if self.moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.moe else "qwen3",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "dtype": "bfloat16",
        }
        if self.moe:
            config.update(
                num_experts=self.experts,
                num_experts_per_tok=self.top_k,
                moe_intermediate_size=self.expert_intermediate,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        return config


SHAPES = {
    # Qwen3-1.7B exactly.
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 151936, tied=True),
    # Qwen3-30B-A3B's layers (128 experts, top-8, 2048 hidden, 32/4 heads), 6 of its 48: 4.4B parameters, so
    # fp32 weights, gradients and AdamW state (16 bytes a parameter) fit one H200 with room for activations.
    "qwen3-30b-a3b-6l": Shape(
        2048, 6, 32, 4, 128, 6144, 151936, tied=False, experts=128, top_k=8, expert_intermediate=768
    ),
    # Tiny shapes for --smoke.
    "tiny": Shape(256, 2, 4, 2, 64, 512, 2048, tied=True),
    "tiny-moe": Shape(256, 2, 4, 2, 64, 512, 2048, tied=False, experts=8, top_k=2, expert_intermediate=128),
}
