"""SFT test fixtures: a reverse-text chat dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reverse_text_jsonl(tmp_path_factory) -> Path:
    """200 chat rows of the built-in reverse_text task, answered correctly."""
    from tandem.envs import load_taskset

    path = tmp_path_factory.mktemp("data") / "reverse_text.jsonl"
    with path.open("w") as handle:
        for task in load_taskset("reverse_text", num_tasks=200).tasks():
            messages = [*task.messages(), {"role": "assistant", "content": task.answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path
