"""Fixtures for environment tests: the shared GSM8K test split, read in place (never copied into the repo)."""

from __future__ import annotations

from pathlib import Path

import pytest

GSM8K_TEST = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"GSM8K test split not found at {GSM8K_TEST} (expected the shared data checkout next to the repo)")
    return GSM8K_TEST
