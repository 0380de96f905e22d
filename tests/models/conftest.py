"""Fixtures for the model tests: the transformers reference each parity test compares tandem's models against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.model_parity import HF_REFERENCE
from support.tiny_models import quiet_transformers  # noqa: F401 (autouse for this directory)


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
