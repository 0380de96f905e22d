"""Fixtures for eval tests: a fake OpenAI-compatible server per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.fake_openai import FakeServer


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server
