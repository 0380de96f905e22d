"""HF architecture name -> `Architecture`. Adding a family: one file under `models/`, one entry here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import (
    deepseek_v3,
    deepseek_v32,
    glm4_moe,
    llama,
    nemotron_h,
    qwen2_5_vl,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from .architecture import Architecture
from .config import ModelConfigError

ARCHITECTURES: dict[str, Architecture] = {
    a.hf_name: a
    for a in (
        qwen3.ARCHITECTURE,
        llama.ARCHITECTURE,
        qwen3_moe.ARCHITECTURE,
        deepseek_v3.ARCHITECTURE,
        deepseek_v32.ARCHITECTURE,
        glm4_moe.ARCHITECTURE,
        qwen3_next.ARCHITECTURE,
        qwen3_5.ARCHITECTURE,
        qwen3_5.MOE_ARCHITECTURE,
        *qwen3_5.MULTIMODAL_ARCHITECTURES,
        nemotron_h.ARCHITECTURE,
        qwen3_vl.ARCHITECTURE,
        qwen3_vl.MOE_ARCHITECTURE,
        qwen2_5_vl.ARCHITECTURE,
    )
}


def get_architecture(hf_config: Mapping[str, Any]) -> Architecture:
    """The registered architecture for a `config.json` dict, or a ModelConfigError listing the supported ones."""
    names = hf_config.get("architectures") or []
    if len(names) != 1:
        raise ModelConfigError(f"config.json must name exactly one architecture, got architectures={names!r}")
    if names[0] not in ARCHITECTURES:
        raise ModelConfigError(f"unsupported architecture {names[0]!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[names[0]]
