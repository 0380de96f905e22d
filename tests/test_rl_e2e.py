"""`tandem rl` end to end on CPU with a tiny model: three processes, policies flowing back, clean stops."""

from __future__ import annotations

import json
import subprocess
import sys


def tandem_rl(model_dir, out, *flags, timeout=300):
    command = [
        sys.executable, "-m", "tandem", "rl", "--model", str(model_dir), "--model.dtype", "float32",
        "--seq-len", "256", "--output-dir", str(out), "--run-name", "rl", "--orchestrator.batch-size", "16",
        "--orchestrator.group-size", "4", "--trainer.optim.lr", "1e-3", *flags,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_sources(tmp_path, env_id="reverse_text"):
    path = tmp_path / "sources.toml"
    path.write_text(
        f'[[orchestrator.source]]\nid = "{env_id}"\nsampling = {{ max_tokens = 16 }}\n'
        "[orchestrator.eval]\ninterval = 2\n"
        '[[orchestrator.eval.source]]\nid = "arithmetic"\nargs = { num_tasks = 3 }\nsampling = { max_tokens = 8 }\n'
    )
    return str(path)


def test_rl_runs_trains_and_serves_each_new_policy(tiny_model_dir, tmp_path):
    result = tandem_rl(
        tiny_model_dir("qwen3"), tmp_path, "@", write_sources(tmp_path), "--max-steps", "3",
        "--orchestrator.async-level", "0", "--orchestrator.no-filter-zero-advantage",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "rl"
    trainer, stream = records(run_dir / "metrics.jsonl"), records(run_dir / "orchestrator_metrics.jsonl")
    rollouts = [r for r in stream if r.get("kind") != "eval"]
    evals = [r for r in stream if r.get("kind") == "eval"]
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2, 3]
    # async_level 0: batch N is sampled by policy N-1, which the trainer holds at step N, so the
    # measured mismatch is the numerical one between the trainer and the inference engine.
    assert all(r["mismatch_kl"] is not None and abs(r["mismatch_kl"]) < 1e-3 for r in trainer), trainer
    assert [r["policy_version"] for r in rollouts] == [0, 1, 2]
    assert all(r["staleness"] == {"1": 16} for r in rollouts)
    for step in (1, 2, 3):
        assert (run_dir / "policies" / f"step-{step:06d}" / "COMPLETE").exists()
    assert "step 3/3" in result.stderr
    # online evals every 2 steps, through the eval stack, in the same metrics stream
    assert [e["step"] for e in evals] == [2]
    assert sum(evals[0][f"eval/arithmetic/{o}"] for o in ("ok", "truncated", "timeout", "error")) == 3
    assert evals[0]["eval/arithmetic/error"] == 0 and evals[0]["eval/arithmetic/reward"] is not None
    assert len((run_dir / "evals" / "step-000002" / "traces.jsonl").read_text().splitlines()) == 3


def test_a_failing_child_stops_the_run_with_its_error(tiny_model_dir, tmp_path):
    result = tandem_rl(tiny_model_dir("qwen3"), tmp_path, "@", write_sources(tmp_path, "no_such_env"), "--max-steps", "2")
    assert result.returncode == 1
    assert "orchestrator exited" in result.stderr and "no_such_env" in result.stderr
