"""The run list: one row per run, built from whatever of its files can be read."""

from __future__ import annotations

from typing import Any

from tandem.dashboard.evals import EvalTraces
from tandem.dashboard.runs import FollowedFile, Outputs, Run, is_number, mtime, run_status


def problems(followed: list[FollowedFile | None]) -> list[str]:
    """What could not be read of a run's files."""
    return [note for item in followed if item is not None for note in item.notes()]


def run_row(outputs: Outputs, run: Run) -> dict[str, Any]:
    """One row of the run list."""
    if run.kind == "eval":
        traces = outputs.followed(run, "traces.jsonl", EvalTraces)
        followed: list[FollowedFile | None] = [traces]
        steps = traces.rollouts if traces else 0
        last_reward = traces.mean_reward if traces else None
    else:
        trainer = outputs.metrics(run, "metrics.jsonl")
        orchestrator = outputs.metrics(run, "orchestrator_metrics.jsonl")
        followed = [trainer, orchestrator, outputs.metrics(run, "inference_metrics.jsonl")]
        steps = max((log.max_step for log in (trainer, orchestrator) if log), default=0)
        reward = orchestrator.steps.last.get("reward") if orchestrator and orchestrator.steps.count else None
        last_reward = reward if is_number(reward) else None
    return {
        "name": run.name,
        "kind": run.kind,
        "status": run_status(run, steps),
        "started": mtime(run.file(f"{run.kind}.toml")) or 0.0,
        "steps": steps,
        "last_reward": last_reward,
        "problems": problems(followed),
    }


def list_runs(outputs: Outputs) -> list[dict[str, Any]]:
    """Every run and eval directly under the outputs directory, newest first."""
    with outputs.lock:
        runs = outputs.runs()
        outputs.forget_missing(runs)
        rows = [run_row(outputs, run) for run in runs]
    return sorted(rows, key=lambda row: row["started"], reverse=True)
