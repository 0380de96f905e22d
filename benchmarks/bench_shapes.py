"""The model shapes of benchmarks/sft_throughput.py and benchmarks/inference.py, once, for both trainers.

`hf_config` gives the Hugging Face config.json tandem (and transformers) builds from; benchmarks/titan_spec.py
turns the same entries into torchtitan's model args: `Qwen3Shape` into Qwen3ModelArgs, `DeepSeekV3Shape` into
DeepSeekV3ModelArgs. `Shape` holds what every family has; a family adds its attention and routing fields and
the config keys that spell them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, kw_only=True)
class Shape(ABC):
    hidden: int
    layers: int
    heads: int
    intermediate: int  # the dense MLP's
    vocab: int
    tied: bool = False
    experts: int = 0  # 0: dense
    top_k: int = 0
    expert_intermediate: int = 0
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_positions: int = 40960

    titan_spec: ClassVar[str]  # the name benchmarks/titan_spec.py registers this family's torchtitan spec under

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    @abstractmethod
    def architecture(self) -> str: ...

    @property
    @abstractmethod
    def model_type(self) -> str: ...

    @abstractmethod
    def family_config(self) -> dict:
        """The config.json keys only this family has."""

    def hf_config(self) -> dict:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "dtype": "bfloat16",
            **self.family_config(),
        }


@dataclass(frozen=True, kw_only=True)
class Qwen3Shape(Shape):
    """Qwen3 (dense) and Qwen3-MoE: GQA with qk-norm; MoE layers route by softmax over all experts, top-k renormed."""

    kv_heads: int
    head_dim: int

    titan_spec: ClassVar[str] = "qwen3_bench"

    @property
    def architecture(self) -> str:
        return "Qwen3MoeForCausalLM" if self.moe else "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.moe else "qwen3"

    def family_config(self) -> dict:
        config = {"num_key_value_heads": self.kv_heads, "head_dim": self.head_dim}
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


@dataclass(frozen=True, kw_only=True)
class DeepSeekV3Shape(Shape):
    """DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (queries straight from `q_proj` when
    `q_lora_rank` is None; keys and values expanded from a `kv_lora_rank` latent; a `qk_rope_head_dim` RoPE part
    shared by all heads), `dense_layers` dense layers first, then MoE layers: sigmoid scores with a correction
    bias, top-k among the `topk_group` best of `n_group` groups, renormed and scaled by `routed_scaling_factor`,
    plus `shared_experts` always-on experts."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    shared_experts: int = 1
    dense_layers: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_positions: int = 8192

    titan_spec: ClassVar[str] = "deepseek_v3_bench"

    @property
    def architecture(self) -> str:
        return "DeepseekV3ForCausalLM"

    @property
    def model_type(self) -> str:
        return "deepseek_v3"

    def family_config(self) -> dict:
        return {
            "num_key_value_heads": self.heads,  # MLA expands the latent into every head
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": True,  # transformers' default, and DeepSeek's checkpoints'
            "n_routed_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_intermediate,
            "n_shared_experts": self.shared_experts,
            "first_k_dense_replace": self.dense_layers,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
        }


@dataclass(frozen=True, kw_only=True)
class Qwen3NextShape(Shape):
    """Qwen3-Next (`Qwen3NextForCausalLM`): every `full_attention_interval`-th layer output-gated GQA attention, the
    others Gated DeltaNet (`linear_*` heads, a causal conv of `conv_kernel`); every layer's MLP an MoE with a gated
    shared expert. Inference only (no torchtitan spec)."""

    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int = 4
    full_attention_interval: int = 4
    shared_expert_intermediate: int = 0

    titan_spec: ClassVar[str] = ""

    @property
    def architecture(self) -> str:
        return "Qwen3NextForCausalLM"

    @property
    def model_type(self) -> str:
        return "qwen3_next"

    def family_config(self) -> dict:
        return {
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": self.full_attention_interval,
            "linear_num_key_heads": self.linear_key_heads,
            "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_key_dim,
            "linear_value_head_dim": self.linear_value_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_intermediate,
            "shared_expert_intermediate_size": self.shared_expert_intermediate,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }


@dataclass(frozen=True, kw_only=True)
class NemotronHShape(Shape):
    """Nemotron-H (`NemotronHForCausalLM`): one mixer a layer by `pattern` (`M` Mamba-2, `*` RoPE-free GQA
    attention, `-` a squared-ReLU MLP). `layers` must equal the pattern's length. Inference only (no torchtitan
    spec)."""

    pattern: str
    kv_heads: int
    head_dim: int
    mamba_heads: int
    mamba_head_dim: int
    state_size: int
    groups: int
    conv_kernel: int = 4
    chunk_size: int = 128

    titan_spec: ClassVar[str] = ""

    @property
    def architecture(self) -> str:
        return "NemotronHForCausalLM"

    @property
    def model_type(self) -> str:
        return "nemotron_h"

    def family_config(self) -> dict:
        assert len(self.pattern) == self.layers, f"pattern {self.pattern!r} is not {self.layers} layers"
        return {
            "hybrid_override_pattern": self.pattern,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "mamba_num_heads": self.mamba_heads,
            "mamba_head_dim": self.mamba_head_dim,
            "ssm_state_size": self.state_size,
            "n_groups": self.groups,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk_size,
        }


# Nemotron-H-8B, one layer's widths: hidden 4096; Mamba-2 128 heads of 64, state 128, 8 groups; attention 32 query /
# 8 KV heads of 128, no RoPE; MLP 21504 (squared ReLU); vocab 131072, untied.
NEMOTRON_H = dict(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=21504,
    vocab=131072,
    mamba_heads=128,
    mamba_head_dim=64,
    state_size=128,
    groups=8,
)

# Qwen3-Next-80B-A3B, one layer's widths: hidden 2048; attention 16 query / 2 KV heads of 256 (a quarter rotated),
# every 4th layer; Gated DeltaNet 16 key / 32 value heads of 128; 512 experts of 512, top-10, one shared of 512.
QWEN3_NEXT = dict(
    hidden=2048,
    heads=16,
    kv_heads=2,
    head_dim=256,
    intermediate=5120,
    vocab=151936,
    experts=512,
    top_k=10,
    expert_intermediate=512,
    shared_expert_intermediate=512,
    linear_key_heads=16,
    linear_value_heads=32,
    linear_key_dim=128,
    linear_value_dim=128,
    rope_theta=1e7,
)

# Moonlight-16B-A3B (moonshotai; DeepseekV3ForCausalLM, 27 layers), one layer's widths: hidden 2048, 16 heads,
# q straight from q_proj, latent rank 512, qk 128 + 64 RoPE, v 128; 64 routed experts of 1408, top-6, 2 shared,
# one group; the first layer dense (11264); sigmoid routing scaled by 2.446; vocab 163840, untied.
MOONLIGHT = dict(
    hidden=2048,
    heads=16,
    intermediate=11264,
    vocab=163840,
    experts=64,
    top_k=6,
    expert_intermediate=1408,
    rope_theta=50000.0,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    shared_experts=2,
    dense_layers=1,
    routed_scaling_factor=2.446,
)

SHAPES: dict[str, Shape] = {
    # Qwen3-1.7B exactly.
    "qwen3-1.7b": Qwen3Shape(
        hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, vocab=151936, tied=True
    ),
    # Qwen3-30B-A3B's layers (128 experts, top-8, 2048 hidden, 32/4 heads), 6 of its 48: 4.4B parameters, so
    # fp32 weights, gradients and AdamW state (16 bytes a parameter) fit one H200 with room for activations.
    "qwen3-30b-a3b-6l": Qwen3Shape(
        hidden=2048,
        layers=6,
        heads=32,
        kv_heads=4,
        head_dim=128,
        intermediate=6144,
        vocab=151936,
        experts=128,
        top_k=8,
        expert_intermediate=768,
    ),
    # Moonlight-16B-A3B's layers, 4 of its 27 (the dense one and 3 MoE): 2.51B parameters (0.67B of them the
    # embedding and LM head), 40 GB of fp32 weights, gradients and AdamW state: fits one 80 GB H100.
    "moonlight-16b-a3b-4l": DeepSeekV3Shape(layers=4, **MOONLIGHT),
    # Tiny shapes for --smoke.
    "tiny": Qwen3Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=2048, tied=True),
    "tiny-moe": Qwen3Shape(
        hidden=256,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=512,
        vocab=2048,
        experts=8,
        top_k=2,
        expert_intermediate=128,
    ),
    # A dense layer and an MoE one; qk head 96 (64 + 32 RoPE) against v 64, as DeepSeek's 192 against 128.
    "tiny-dsv3": DeepSeekV3Shape(
        hidden=256,
        layers=2,
        heads=4,
        intermediate=512,
        vocab=2048,
        experts=8,
        top_k=2,
        expert_intermediate=128,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        shared_experts=1,
        routed_scaling_factor=2.446,
    ),
}
