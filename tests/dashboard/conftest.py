"""Dashboard fixtures: a synthetic outputs directory with an RL run, an SFT run and an eval."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.dashboard_records import heartbeat, rollout, trace
from support.jsonl import write_jsonl

OLD = 1_700_000_000  # an mtime far in the past: nothing written recently


@pytest.fixture
def outputs(tmp_path) -> Path:
    """rl-run (finished, 5 steps, resumed from step 3, half-written last line, rollouts, a server heartbeat),
    sft-old (failed), evals (running, no summary)."""
    rl = tmp_path / "rl-run"
    rl.mkdir()
    (rl / "rl.toml").write_text("max_steps = 5\n[trainer]\nmax_steps = 5\n")
    # entropy: a range narrower than its value's 3 decimals; resumed after step 3's checkpoint
    trainer = [
        {"step": s, "loss": 1.0 / s, "grad_norm": 2.0, "masked_low": 0.01, "masked_high": 0.02, "idle_s": float(s),
         "mismatch_kl": 1e-3 if s == 1 else None, "off_policy_kl/lag1": None if s == 1 else 0.01 * s,
         "off_policy_kl": 0.01 * s, "entropy": 10.37411 + 1e-5 * s, **({"resumed_from": 3} if s == 4 else {})}
        for s in range(1, 6)
    ]  # fmt: skip
    write_jsonl(rl / "metrics.jsonl", trainer, tail='{"step": 6, "lo')
    orchestrator = [
        {"step": s, "reward": 0.1 * s, "reward/a": 0.2 * s, "staleness": {"0": 3, "1": 1}, "inference_idle_s": s * s}
        for s in range(1, 6)
    ]
    orchestrator.insert(2, {"kind": "eval", "step": 2, "eval/a/reward": 0.5, "eval/a/pass@1": 0.5, "eval/a/ok": 4})
    write_jsonl(rl / "orchestrator_metrics.jsonl", orchestrator)
    write_jsonl(rl / "rollouts.jsonl", [rollout(i) for i in range(10)])
    write_jsonl(rl / "inference_metrics.jsonl", [heartbeat(i) for i in range(4)])

    sft = tmp_path / "sft-old"
    sft.mkdir()
    (sft / "sft.toml").write_text("max_steps = 100\n")
    write_jsonl(sft / "metrics.jsonl", [{"step": 1, "loss": 3.0}])
    for path in (sft / "sft.toml", sft / "metrics.jsonl"):
        os.utime(path, (OLD, OLD))

    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "eval.toml").write_text("")
    outcomes = ["ok", "ok", "timeout", "truncated", "ok", "error"]
    records = [trace(i, "a" if i < 4 else "b", o, 1.0 if i % 2 == 0 else 0.0) for i, o in enumerate(outcomes)]
    write_jsonl(evals / "traces.jsonl", records)

    (tmp_path / "not-a-run").mkdir()
    return tmp_path
