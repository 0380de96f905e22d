"""torchtitan's side of benchmarks/sft_throughput.py: its own train specs, on the benchmark's shapes and data.

torchtitan's trainer imports this with `--experimental.custom_import titan_spec` (benchmarks/ on PYTHONPATH).
It registers one spec per model family, named by the shape class (`Qwen3Shape.titan_spec`: `qwen3_bench`,
`DeepSeekV3Shape.titan_spec`: `deepseek_v3_bench`): torchtitan's Qwen3 or DeepSeek-V3 model, parallelisation,
compile, optimizer and loss unchanged, with one flavor per benchmark shape of that family and, instead of a
tokenizer and a text dataset, rows of random tokens drawn exactly as tandem's `--data.fake` draws them (so both
trainers see the same tokens). Written against torchtitan 0.2.2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from bench_shapes import SHAPES, DeepSeekV3Shape, Qwen3Shape, Shape
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.models import deepseek_v3, qwen3
from torchtitan.models.moe import MoEArgs
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

SEED = 0  # tandem's default `seed`


def qwen3_args(shape: Qwen3Shape) -> qwen3.Qwen3ModelArgs:
    moe = MoEArgs(
        num_experts=shape.experts,
        num_shared_experts=0,
        top_k=shape.top_k,
        score_func="softmax",
        route_norm=True,  # Qwen3-MoE's norm_topk_prob
        score_before_experts=False,
        load_balance_coeff=None,  # Qwen3 has no expert-bias balancing; tandem does none either
    )
    return qwen3.Qwen3ModelArgs(
        dim=shape.hidden,
        n_layers=shape.layers,
        n_heads=shape.heads,
        n_kv_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        head_dim=shape.head_dim,
        hidden_dim=shape.intermediate,
        rope_theta=shape.rope_theta,
        qk_norm=True,
        enable_weight_tying=shape.tied,
        moe_enabled=shape.moe,
        moe_inter_dim=shape.expert_intermediate or 768,
        moe_args=moe if shape.moe else MoEArgs(),
    )


def deepseek_v3_args(shape: DeepSeekV3Shape) -> deepseek_v3.DeepSeekV3ModelArgs:
    """The shape as torchtitan's DeepSeek-V3: MLA through SDPA with a causal mask (the model args' default;
    torchtitan's own 16B and 671B flavors pick flex with a block-causal mask, which needs a tokenizer's EOS and
    attends like SDPA on rows of one document, which these are), sigmoid routing, renormed and scaled."""
    if shape.tied:
        raise ValueError("torchtitan's DeepSeek-V3 has no weight tying")
    moe = MoEArgs(
        num_experts=shape.experts,
        num_shared_experts=shape.shared_experts,
        top_k=shape.top_k,
        score_func="sigmoid",
        route_norm=True,  # norm_topk_prob
        route_scale=shape.routed_scaling_factor,
        score_before_experts=False,  # weights applied to the experts' outputs, as transformers and tandem do
        num_expert_groups=shape.n_group if shape.n_group > 1 else None,
        num_limited_groups=shape.topk_group if shape.n_group > 1 else None,
        # No expert bias and no bias updates between steps: tandem's correction bias is a fixed buffer, and with
        # `debug.moe_force_load_balance` (tandem: `speed.moe_balanced_routing`) neither router's choice is used.
        load_balance_coeff=None,
    )
    return deepseek_v3.DeepSeekV3ModelArgs(
        vocab_size=shape.vocab,
        dim=shape.hidden,
        inter_dim=shape.intermediate,
        moe_inter_dim=shape.expert_intermediate,
        n_layers=shape.layers,
        n_dense_layers=shape.dense_layers,
        n_heads=shape.heads,
        norm_eps=shape.rms_norm_eps,
        moe_args=moe,
        q_lora_rank=shape.q_lora_rank or 0,  # 0: queries straight from wq
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        attn_type="sdpa",
        attn_mask_type="causal",
        rope_theta=shape.rope_theta,
        # torchtitan applies YaRN past `original_seq_len`; the HF config has no rope_scaling, so neither does this
        original_seq_len=shape.max_positions,
        max_seq_len=shape.max_positions,  # torchtitan sets it to training.seq_len
    )


class RandomTokens(BaseDataLoader):
    """Step n: `randint(vocab, (batch, seq + 1))` from a generator seeded `SEED * 1_000_003 + n`, like FakeSteps."""

    def __init__(self, vocab: int, seq_len: int, batch: int):
        self.vocab, self.seq_len, self.batch, self.step = vocab, seq_len, batch, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            generator = torch.Generator().manual_seed(SEED * 1_000_003 + self.step)
            tokens = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=generator)
            self.step += 1
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]


def build_random_tokens(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs) -> RandomTokens:
    shape = SHAPES[job_config.model.flavor]
    return RandomTokens(shape.vocab, job_config.training.seq_len, job_config.training.local_batch_size)


FAMILIES: dict[type[Shape], tuple[Callable[[], TrainSpec], Callable[..., BaseModelArgs]]] = {
    Qwen3Shape: (qwen3.get_train_spec, qwen3_args),
    DeepSeekV3Shape: (deepseek_v3.get_train_spec, deepseek_v3_args),
}
FLAVORS: dict[str, dict[str, BaseModelArgs]] = {
    family.titan_spec: {name: to_args(shape) for name, shape in SHAPES.items() if type(shape) is family}
    for family, (_, to_args) in FAMILIES.items()
}
for family, (train_spec, _) in FAMILIES.items():
    register_train_spec(
        family.titan_spec,
        dataclasses.replace(
            train_spec(),
            model_args=FLAVORS[family.titan_spec],
            build_dataloader_fn=build_random_tokens,
            build_tokenizer_fn=None,
            build_validator_fn=None,
        ),
    )
