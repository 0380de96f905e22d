"""An online eval of step N that runs again (a resumed RL run redoes the steps after its checkpoint) starts its
trace stream anew: the traces hold each rollout once, as the metrics it reports do."""

from __future__ import annotations

import asyncio
from collections import Counter

from tandem.config.orchestrator import OnlineEvalConfig
from tandem.eval.traces import read_traces
from tandem.jsonl import read_records
from tandem.orchestrator.evals import run_online_eval


def test_a_rerun_online_eval_rewrites_its_traces(tmp_path, fake_server):
    config = OnlineEvalConfig.model_validate(
        {"interval": 1, "source": [{"id": "arithmetic", "args": {"num_tasks": 3}, "rollouts_per_task": 2}]}
    )
    out_dir = tmp_path / "evals" / "step-000002"
    for _ in range(2):  # the killed run's eval of step 2, then the resumed run's
        metrics = asyncio.run(run_online_eval(config, f"{fake_server.url}/v1", None, out_dir))
    lines = read_records(out_dir / "traces.jsonl")
    assert len(lines) == 6 and Counter(r["key"] for r in lines).most_common(1)[0][1] == 1
    assert len(read_traces(out_dir / "traces.jsonl")) == 6
    assert metrics["eval/arithmetic/ok"] == 6
