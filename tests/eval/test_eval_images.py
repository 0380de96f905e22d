"""`tandem eval count_shapes --model DIR`: the built-in server started for a tiny Qwen3-VL, each task's image sent
inline to chat completions and every rollout scored."""

from __future__ import annotations

import pytest

from support.jsonl import read_jsonl
from support.vision_models import write_servable_vl_model
from tandem.cli import main

pytest.importorskip("PIL", reason="images need Pillow")


def test_count_shapes_eval_of_a_tiny_vl_model_runs_end_to_end(tmp_path):
    model = write_servable_vl_model(tmp_path / "model")
    argv = [
        "eval", "count_shapes", "--model", str(model), "--model.dtype", "float32", "--seq-len", "512",
        "--env.select.limit", "3", "--env.rollouts-per-task", "2", "--env.sampling.max-tokens", "6",
        "--output-dir", str(tmp_path), "--run-name", "shapes", "--startup-timeout-s", "120",
    ]  # fmt: skip
    assert main(argv) == 0
    traces = read_jsonl(tmp_path / "shapes" / "traces.jsonl")
    assert len(traces) == 6 and {t["outcome"] for t in traces} <= {"ok", "truncated"}
    # each prompt ran with its 64 x 64 image: 64 placeholder tokens beyond the text
    assert all(t["tokens"]["prompt"] > 64 and t["reward"] in (0.0, 1.0) for t in traces), traces[0]["tokens"]
