"""torchtitan's side of benchmarks/sft_throughput.py: its own Qwen3 train spec, on the benchmark's shapes and data.

torchtitan's trainer imports this with `--experimental.custom_import titan_spec` (benchmarks/ on PYTHONPATH).
It registers `qwen3_bench`: torchtitan's Qwen3 model, parallelisation, compile, optimizer and loss unchanged,
with one flavor per benchmark shape and, instead of a tokenizer and a text dataset, rows of random tokens
drawn exactly as tandem's `--data.fake` draws them (so both trainers see the same tokens). Written against
torchtitan 0.2.2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from bench_shapes import SHAPES, Shape
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs, get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

SEED = 0  # tandem's default `seed`


def model_args(shape: Shape) -> Qwen3ModelArgs:
    moe = MoEArgs(
        num_experts=shape.experts,
        num_shared_experts=0,
        top_k=shape.top_k,
        score_func="softmax",
        route_norm=True,  # Qwen3-MoE's norm_topk_prob
        score_before_experts=False,
        load_balance_coeff=None,  # Qwen3 has no expert-bias balancing; tandem does none either
    )
    return Qwen3ModelArgs(
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
    flavor = FLAVORS[job_config.model.flavor]
    return RandomTokens(flavor.vocab_size, job_config.training.seq_len, job_config.training.local_batch_size)


FLAVORS = {name: model_args(shape) for name, shape in SHAPES.items()}
register_train_spec(
    "qwen3_bench",
    dataclasses.replace(
        get_train_spec(),
        model_args=FLAVORS,
        build_dataloader_fn=build_random_tokens,
        build_tokenizer_fn=None,
        build_validator_fn=None,
    ),
)
