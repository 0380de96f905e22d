"""Run `tandem sft` as a user would and read what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandem.testing.progress import run_while_progressing


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sft_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem", "sft", *args]


def output_dirs(args: tuple[str, ...]) -> list[Path]:
    """The `--output-dir` a run was given: watched for progress (a run writes metrics.jsonl every step)."""
    return [Path(args[args.index("--output-dir") + 1])] if "--output-dir" in args else []


def run_sft(*args: str) -> subprocess.CompletedProcess:
    """Run `tandem sft` to its end, for as long as it makes progress (no wall-clock timeout)."""
    result = run_while_progressing(sft_command(*args), watch=output_dirs(args))
    assert result.returncode == 0, result.stderr[-3000:]
    return result
