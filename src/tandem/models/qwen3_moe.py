"""Qwen3-MoE: Qwen3 attention; MoE MLP on every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import ModelArgs, MoEArgs, parse_decoder_args, require


def parse(hf: Mapping[str, Any]) -> ModelArgs:
    num_experts = hf.get("num_experts") or require(hf, "num_local_experts")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(require(hf, "num_hidden_layers")) if i not in dense and (i + 1) % step == 0)
    moe = MoEArgs(
        num_experts=num_experts,
        top_k=require(hf, "num_experts_per_tok"),
        intermediate_size=require(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        layers=layers,
    )
    return parse_decoder_args(hf, qk_norm=True, moe=moe)


ARCHITECTURE = Architecture("Qwen3MoeForCausalLM", parse)
