"""SFT test helpers: a reverse-text chat dataset and a way to run `tandem sft` as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
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


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sft_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem", "sft", *args]


def run_sft(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(sft_command(*args), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
