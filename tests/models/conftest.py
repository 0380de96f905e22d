"""Fixtures for the model tests: tiny HF directories with weights large enough that bugs show in the logits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

# With HF's default std of 0.02 attention is nearly uniform and some bugs move logits by little; 0.1 makes
# logits O(1) so a wrong mask, rope or norm changes them by far more than the parity tolerance.
INIT_STD = 0.1
# The plain transformers implementations as the reference: eager attention and the per-expert loop (some
# transformers versions default to a grouped_mm experts kernel that disagrees with their own loop on CPU).
HF_REFERENCE = {"dtype": torch.float32, "attn_implementation": "eager", "experts_implementation": "eager"}


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    """`model_dir(arch)` -> a tiny HF directory written by transformers, with INIT_STD weights."""

    def make(arch: str) -> Path:
        return tiny_model_dir(arch, initializer_range=INIT_STD)

    return make


@pytest.fixture(scope="session")
def hf_model():
    """`hf_model(path)` -> the transformers reference model for a directory (HF_REFERENCE), cached."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, **HF_REFERENCE).eval()
        return cache[path]

    return load
