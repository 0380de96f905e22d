"""The live view of `tandem rl` follows metric files that a resuming child rewrites under it."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from tandem.files import atomic_write_text
from tandem.view import RlProgress


def lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def trainer(step):
    return {"step": step, "loss": 0.1 * step, "mismatch_kl": 1e-4}


def test_a_rewritten_metrics_file_is_followed_from_its_start(tmp_path, caplog):
    run_dir = tmp_path / "rl"
    run_dir.mkdir()
    progress = RlProgress(SimpleNamespace(run_dir=run_dir, max_steps=6), start_step=2)
    orchestrator, metrics = run_dir / "orchestrator_metrics.jsonl", run_dir / "metrics.jsonl"
    # History up to the step resumed from, longer lines than the rewrite below: a byte offset into the old
    # file lands mid-line in the new one.
    old = [{"step": s, "reward": 0.5, "padding": "x" * 200} for s in (1, 2, 3, 4)]
    orchestrator.write_text(lines(*old))
    metrics.write_text(lines(trainer(1), trainer(2)))
    with caplog.at_level(logging.INFO, logger="tandem.view"):
        progress.refresh()
        atomic_write_text(orchestrator, lines({"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}))
        progress.refresh()
        assert sorted(progress.rollouts) == [1, 2]  # the stale steps 3 and 4 are gone
        with orchestrator.open("a") as handle:
            handle.write(lines({"step": 3, "reward": 0.75}))
        atomic_write_text(metrics, lines(trainer(1), trainer(2), trainer(3)))  # the trainer rewrites too
        progress.refresh()
    progress.close()
    shown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(shown) == 1 and shown[0].startswith("step 3/6  reward 0.750"), shown  # history not shown again
