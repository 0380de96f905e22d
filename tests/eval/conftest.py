"""Fixtures for eval tests: a fake OpenAI-compatible server per test, the shared GSM8K test split."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_server import FakeServer

GSM8K_TEST = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture
def fake_server():
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"GSM8K test split not found at {GSM8K_TEST} (expected the shared data checkout next to the repo)")
    return GSM8K_TEST
