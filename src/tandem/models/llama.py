"""Llama: the shared decoder without qk-norm; MLP and attention biases as the config says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import ModelArgs, parse_decoder_args


def parse(hf: Mapping[str, Any]) -> ModelArgs:
    return parse_decoder_args(hf, qk_norm=False, mlp_bias=bool(hf.get("mlp_bias", False)))


ARCHITECTURE = Architecture("LlamaForCausalLM", parse)
