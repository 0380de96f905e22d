"""Qwen3 dense: the shared decoder with per-head RMSNorm on queries and keys (qk-norm)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import ModelArgs, parse_decoder_args


def parse(hf: Mapping[str, Any]) -> ModelArgs:
    return parse_decoder_args(hf, qk_norm=True)


ARCHITECTURE = Architecture("Qwen3ForCausalLM", parse)
