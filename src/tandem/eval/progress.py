"""Live progress on stderr: a row per source (done/total, mean reward so far, failures, ETA) and the concurrency."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from tandem.eval.concurrency import AdaptiveLimiter
from tandem.run import console


class _SourceStats:
    def __init__(self) -> None:
        self.reward_sum = 0.0
        self.scored = self.timeouts = self.errors = 0

    def add(self, record: dict[str, Any]) -> None:
        if record["outcome"] == "error":
            self.errors += 1
            return
        self.timeouts += record["outcome"] == "timeout"
        self.scored += 1
        self.reward_sum += record["reward"]

    def describe(self) -> str:
        reward = f"{self.reward_sum / self.scored:.3f}" if self.scored else "-"
        return f"reward {reward}  timeout {self.timeouts}  error {self.errors}"


class EvalProgress:
    """Counts earlier (resumed) records as done; `add` each record as it is written."""

    def __init__(self, totals: dict[str, int], done: Iterable[dict[str, Any]], limiter: AdaptiveLimiter) -> None:
        self._limiter = limiter
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=console(),
        )
        self._stats = {name: _SourceStats() for name in totals}
        self._rows: dict[str, TaskID] = {}
        self._all = self._progress.add_task("all", total=sum(totals.values()), stats=self._concurrency())
        for name, total in totals.items():
            self._rows[name] = self._progress.add_task(name, total=total, stats="")
        for record in done:
            self._count(record)
        for name, row in self._rows.items():
            self._progress.update(row, stats=self._stats[name].describe())

    def _concurrency(self) -> str:
        queue = self._limiter.server_queue
        waiting = "" if queue is None else f", {queue} queued on the server"
        return f"concurrency {self._limiter.limit} ({self._limiter.in_flight} in flight{waiting})"

    def _count(self, record: dict[str, Any]) -> None:
        self._stats[record["source"]].add(record)
        self._progress.advance(self._rows[record["source"]])
        self._progress.advance(self._all)

    def add(self, record: dict[str, Any]) -> None:
        self._count(record)
        name = record["source"]
        self._progress.update(self._rows[name], stats=self._stats[name].describe())
        self._progress.update(self._all, stats=self._concurrency())

    def __enter__(self) -> EvalProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()
