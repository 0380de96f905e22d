"""Shared fixtures: tiny offline HF model directories, one per architecture, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU, Triton kernels run under Triton's interpreter; it is read when a kernel is defined, so here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: `tiny_model_dir("qwen3" | "llama" | "qwen3_moe", **config_overrides)` -> a HF directory."""
    from tandem.testing import write_tiny_model

    cache: dict[tuple, Path] = {}

    def make(arch: str = "qwen3", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return cache[key]

    return make
