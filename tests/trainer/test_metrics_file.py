"""metrics.jsonl across resumes: the steps past the checkpoint go, and the first step after a resume says where
the run resumed (what the dashboard marks on its charts)."""

from __future__ import annotations

from tandem.jsonl import read_records
from tandem.trainer.metrics import MetricsWriter


def run_steps(path, steps: range, resume_step: int = 0) -> None:
    with MetricsWriter(path, resume_step) as writer:
        for step in steps:
            writer.write({"step": step, "loss": 1.0 / step})


def test_the_first_step_after_a_resume_records_the_step_resumed_from(tmp_path):
    path = tmp_path / "metrics.jsonl"
    run_steps(path, range(1, 6))  # killed after step 5, its newest checkpoint at step 2
    assert all("resumed_from" not in record for record in read_records(path))
    run_steps(path, range(3, 5), resume_step=2)  # killed again after step 4, checkpoint at step 3
    run_steps(path, range(4, 7), resume_step=3)
    records = read_records(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r.get("resumed_from") for r in records] == [None, None, 2, 3, None, None]
