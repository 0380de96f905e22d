"""benchmarks/rl_throughput.py --smoke: every run kind (tandem rl at both async levels, full fine-tuning and LoRA, the
SFT, engine and trainer replay baselines) goes through the same code as on the GPU, with a tiny model on CPU, and
reports its numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tandem.testing.progress import run_while_progressing

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "rl-tiny-async1-default": "rl",
    "rl-tiny-async1-lora": "rl",
    "rl-tiny-async0-default": "rl",
    "rl-tiny-async0-lora": "rl",
    "sft-tiny": "trainer",
    "replay-tiny-default": "trainer",
    "replay-tiny-lora": "trainer",
    "decode-tiny": "decode",
}
POSITIVE = {
    "rl": ("step_s", "train_s", "tokens_per_s", "rollout_tokens_per_s", "busy_tokens_per_s", "vs_sync", "vs_ideal"),
    "trainer": ("train_s", "tokens_per_s"),
    "decode": ("decode_s", "tokens_per_s"),
}


@pytest.mark.slow
def test_smoke_runs_every_run_and_reports_positive_numbers(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "rl_throughput.py"), "--smoke", "--out", str(out),
               "--work-dir", str(tmp_path / "work")]  # fmt: skip
    result = run_while_progressing(command, watch=[tmp_path / "work"])
    assert result.returncode == 0, result.stderr[-4000:]
    table = result.stdout[result.stdout.index("steady step =") :]
    results = {r["run"]["name"]: r for r in json.loads(out.read_text())}
    assert set(results) == set(RUNS), result.stdout[-4000:]
    for name, kind in RUNS.items():
        assert not results[name]["error"], results[name]["error"]
        assert f"\n{name} " in table, table
        metrics = results[name]["metrics"]
        for key in POSITIVE[kind]:
            assert metrics[key] is not None and metrics[key] > 0, (name, key, metrics)
    for name in ("rl-tiny-async1-default", "rl-tiny-async0-default"):
        metrics = results[name]["metrics"]
        assert metrics["fixed_length"], metrics  # ignore_eos: every rollout is gen_len tokens long
        assert 0 <= metrics["trainer_idle"] <= 1 and 0 <= metrics["inference_idle"] <= 1, metrics
        assert metrics["train_alone_s"] > 0 and metrics["decode_alone_s"] > 0, metrics
