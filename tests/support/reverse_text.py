"""The README's reverse-text RL example at CI size: two-word phrases, an SFT on mixed answers, then RL scored
by greedy decoding of held-out prompts (tests/test_rl_learns.py, tests/test_rl_lora.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from support.jsonl import read_jsonl
from support.paths import EXAMPLES
from support.runs import run_tandem, run_to_end, tandem_sft

EXAMPLE = EXAMPLES / "reverse_text"
SOURCES = """\
[[orchestrator.source]]
id = "reverse_text"
args = { seed = 2, max_words = 2 }
sampling = { temperature = 1.0, max_tokens = 24 }

[[orchestrator.eval.source]]
id = "reverse_text"
name = "held-out"
args = { seed = 1, num_tasks = 32, max_words = 2 }
sampling = { temperature = 0.0, max_tokens = 24 }
"""


def mixed_start(tmp_path: Path) -> Path:
    """`prepare.py` (1000 two-word rows) and 100 steps of `sft.toml @ sft_mixed.toml`: the RL starting point."""
    data = tmp_path / "data"
    prepare = [sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(data), "--train-rows", "1000"]
    run_to_end([*prepare, "--max-words", "2"], watch=[data])
    tandem_sft("@", str(EXAMPLE / "sft.toml"), "@", str(EXAMPLE / "sft_mixed.toml"), "--model.name", str(data / "model"),
               "--data.path", str(data / "train_mixed.jsonl"), "--output-dir", str(tmp_path), "--max-steps", "100",
               "--ckpt.hf-interval", "0")  # fmt: skip
    return tmp_path / "reverse-text-sft-mixed" / "hf" / "final"


def held_out_rl(tmp_path: Path, start: Path, steps: int, *flags: str) -> tuple[list[float], Path]:
    """`rl.toml` from `start` for `steps` steps of 128 rollouts; the held-out greedy reward before the first step
    and after the last, and the run directory."""
    sources = tmp_path / "sources.toml"
    sources.write_text(SOURCES)
    run_tandem("rl", "@", str(EXAMPLE / "rl.toml"), "@", str(sources), "--model.name", str(start),
               "--output-dir", str(tmp_path), "--max-steps", str(steps), "--seq-len", "256",
               "--orchestrator.batch-size", "128", "--orchestrator.eval.interval", str(steps), *flags)  # fmt: skip
    run = tmp_path / "reverse-text-rl"
    evals = [r for r in read_jsonl(run / "orchestrator_metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, steps], evals
    return [r["eval/held-out/reward"] for r in evals], run
