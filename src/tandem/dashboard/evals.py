"""An eval run's per-source summary, from `summary.json` or, while the eval runs, from its trace stream."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from tandem.dashboard.runs import Outputs, Run, is_number
from tandem.eval.summary import OUTCOMES, summarize_source
from tandem.jsonl import JsonlFollower


def summary_fields(record: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(source, the fields `summarize_source` reads) of a trace record; None if any is missing or mistyped."""
    task, tokens, source = record.get("task"), record.get("tokens"), record.get("source", "?")
    if not (isinstance(task, dict) and isinstance(tokens, dict) and isinstance(source, str)):
        return None
    fields = {
        "outcome": record.get("outcome"),
        "reward": record.get("reward"),
        "task": {"id": task.get("id")},
        "tokens": {"prompt": tokens.get("prompt"), "completion": tokens.get("completion")},
        "latency_s": record.get("latency_s"),
    }
    numbers = (fields["reward"], *fields["tokens"].values(), fields["latency_s"])
    if (
        fields["outcome"] not in OUTCOMES
        or not isinstance(task.get("id"), str | int)
        or not all(map(is_number, numbers))
    ):
        return None
    return source, fields


class EvalTraces:
    """An eval's `traces.jsonl`, followed as it grows, keeping of each rollout only the numbers its summary needs
    (never its prompt or completion), so memory grows with the rollouts, not with their text.

    A record whose `key` was seen before counts once; a record missing a field the summary needs is skipped
    and counted.
    """

    def __init__(self, path: Path):
        self.path = path
        self._follower = JsonlFollower(path)
        self.error: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.keys: set[str] = set()
        self.rollouts = 0
        self.reward_sum = 0.0
        self._unusable = 0
        self.duplicates = 0

    def notes(self) -> list[str]:
        """What could not be read or counted: the file, corrupt or unusable lines, repeated rollouts."""
        skipped = self._follower.report.corrupt + self._unusable
        notes = [self.error] if self.error else []
        if skipped:
            notes.append(f"{self.path.name}: {skipped} corrupt or incomplete lines skipped")
        if self.duplicates:
            notes.append(f"{self.path.name}: {self.duplicates} repeated rollouts counted once")
        return notes

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rollouts if self.rollouts else None

    def update(self) -> EvalTraces:
        try:
            records = self._follower.new_records()
        except OSError as error:
            self.error = f"{self.path.name}: {error.strerror or error}"
            return self
        self.error = None
        if self._follower.restarted:
            self._reset()
        for record in records:
            self._add(record)
        return self

    def _add(self, record: dict[str, Any]) -> None:
        found = summary_fields(record)
        if found is None:
            self._unusable += 1
            return
        key = record.get("key")
        if isinstance(key, str):
            if key in self.keys:
                self.duplicates += 1
                return
            self.keys.add(key)
        source, fields = found
        self.by_source[source].append(fields)
        self.rollouts += 1
        self.reward_sum += fields["reward"]

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
    return sources if isinstance(sources, dict) else None


def eval_summary(outputs: Outputs, run: Run) -> dict[str, Any]:
    """`{"final": bool, "sources": {source: summary}}`: the written summary, or one computed from the traces so far."""
    sources = written_summary(run)
    if sources is not None:
        return {"final": True, "sources": sources}
    traces = outputs.followed(run, "traces.jsonl", EvalTraces)
    return {"final": False, "sources": traces.summaries() if traces else {}}
