"""`tandem eval gsm8k --model DIR`: the built-in server started for a tiny model, on the shared GSM8K file."""

from __future__ import annotations

import json

from support.jsonl import read_jsonl
from tandem.cli import main


def test_gsm8k_eval_of_a_tiny_model_runs_end_to_end(tiny_model_dir, gsm8k_path, tmp_path):
    argv = [
        "eval", "gsm8k", "--model", str(tiny_model_dir("qwen3")), "--model.dtype", "float32", "--seq-len", "512",
        "--env.args", f'{{path = "{gsm8k_path.resolve()}"}}', "--env.select.limit", "4", "--env.rollouts-per-task", "2",
        "--env.sampling.max-tokens", "8", "--env.sampling.seed", "1",
        "--output-dir", str(tmp_path), "--run-name", "gsm8k", "--startup-timeout-s", "120",
    ]  # fmt: skip
    assert main(argv) == 0
    run_dir = tmp_path / "gsm8k"
    traces = read_jsonl(run_dir / "traces.jsonl")
    assert len(traces) == 8  # 4 tasks x 2 rollouts, each once
    assert len({t["key"] for t in traces}) == 8
    assert {t["outcome"] for t in traces} <= {"ok", "truncated"}  # a random tiny model: no errors, score ~0
    assert all(t["tokens"]["completion"] > 0 and t["reward"] in (0.0, 1.0) for t in traces)
    summary = json.loads((run_dir / "summary.json").read_text())
    source = next(iter(summary["sources"].values())) if "sources" in summary else next(iter(summary.values()))
    assert sum(source["outcomes"].values()) == 8
    assert (run_dir / "logs").is_dir()
