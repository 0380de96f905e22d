"""Fixtures every directory may use: tiny offline HF model directories (built once per session), the shared GSM8K
split."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from support.paths import GSM8K_TEST
from support.tiny_models import INIT_STD

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


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    """`model_dir(arch="qwen3")` -> a tiny HF directory (trained tokenizer, ChatML template) with INIT_STD weights."""

    def make(arch: str = "qwen3") -> Path:
        return tiny_model_dir(arch, initializer_range=INIT_STD)

    return make


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    """The shared GSM8K test split, read in place; tests that need it skip, saying so, where it is missing."""
    if not GSM8K_TEST.is_file():
        pytest.skip(f"GSM8K test split not found at {GSM8K_TEST} (expected the shared data checkout next to the repo)")
    return GSM8K_TEST
