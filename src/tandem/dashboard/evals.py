"""An eval run's per-source summary, from `summary.json` or, while the eval runs, from its trace stream."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from tandem.dashboard.runs import FollowedFile, Outputs, Run
from tandem.eval.summary import summarize_source
from tandem.eval.traces import is_trace


def summary_fields(record: dict[str, Any]) -> dict[str, Any]:
    """What `summarize_source` reads of a trace record (`is_trace` checked it has each field)."""
    return {
        "outcome": record["outcome"],
        "reward": record["reward"],
        "task": {"id": record["task"]["id"]},
        "tokens": {"prompt": record["tokens"]["prompt"], "completion": record["tokens"]["completion"]},
        "latency_s": record["latency_s"],
    }


class EvalTraces(FollowedFile):
    """An eval's `traces.jsonl`, keeping of each rollout only the numbers its summary needs
    (never its prompt or completion), so memory grows with the rollouts, not with their text.

    As `tandem.eval.traces.read_traces` reads them: a record that is not a trace (`is_trace`) is skipped and
    counted, and a later record for a key already read is skipped (a rollout counts once).
    """

    def _reset(self) -> None:
        self.by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.keys: set[str] = set()
        self.rollouts = 0
        self.reward_sum = 0.0
        self.incomplete = 0
        self.duplicates = 0

    def notes(self) -> list[str]:
        notes = super().notes()
        if self.incomplete:
            notes.append(f"{self.path.name}: {self.incomplete} incomplete trace records skipped")
        if self.duplicates:
            notes.append(f"{self.path.name}: {self.duplicates} repeated rollouts counted once")
        return notes

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rollouts if self.rollouts else None

    def _add(self, record: dict[str, Any]) -> None:
        if not is_trace(record):
            self.incomplete += 1
        elif record["key"] in self.keys:
            self.duplicates += 1
        else:
            self.keys.add(record["key"])
            self.by_source[record["source"]].append(summary_fields(record))
            self.rollouts += 1
            self.reward_sum += record["reward"]

    def summaries(self) -> dict[str, dict[str, Any]]:
        sources = {}
        for source, records in self.by_source.items():
            per_task = Counter(r["task"]["id"] for r in records)
            sources[source] = summarize_source(
                records, expected=len(records), rollouts_per_task=max(per_task.values()), pass_threshold=1.0
            )
        return sources


def written_summary(run: Run) -> dict[str, Any] | None:
    """The sources of the eval's `summary.json`, or None if it is missing or not a summary."""
    path = run.file("summary.json")
    try:
        sources = json.loads(path.read_text())["sources"] if path else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    valid = isinstance(sources, dict) and all(isinstance(summary, dict) for summary in sources.values())
    return sources if valid else None


def eval_summary(outputs: Outputs, run: Run) -> dict[str, Any]:
    """`{"final": bool, "sources": {source: summary}}`: the written summary, or one computed from the traces so far."""
    sources = written_summary(run)
    if sources is not None:
        return {"final": True, "sources": sources}
    traces = outputs.followed(run, "traces.jsonl", EvalTraces)
    return {"final": False, "sources": traces.summaries() if traces else {}}
