"""Run `tandem sft` as a user would and read what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sft_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem", "sft", *args]


def run_sft(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(sft_command(*args), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
