"""Filtered, paged samples of a per-rollout JSONL file: an eval's `traces.jsonl` or an RL run's `rollouts.jsonl`.

The file is streamed on each request and only the requested page is kept, so memory is bounded by the page,
not by the file, however long the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.dashboard.runs import is_number
from tandem.jsonl import iter_records

MAX_SOURCES = 200


@dataclass(frozen=True)
class SampleFilter:
    """Which records to show; None keeps every value. A reward bound keeps only records with a numeric reward."""

    step: int | None = None
    source: str | None = None
    outcome: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None

    def keep(self, record: dict[str, Any]) -> bool:
        reward = record.get("reward")
        if self.step is not None and record.get("step") != self.step:
            return False
        if self.source is not None and record.get("source") != self.source:
            return False
        if self.outcome is not None and record.get("outcome") != self.outcome:
            return False
        if (self.min_reward is not None or self.max_reward is not None) and not is_number(reward):
            return False
        return (self.min_reward is None or reward >= self.min_reward) and (
            self.max_reward is None or reward <= self.max_reward
        )


def sample_page(path: Path | None, where: SampleFilter, *, offset: int, limit: int) -> dict[str, Any]:
    """`{"total": matches, "samples": [the page], "sources": [every source in the file]}` (at most `MAX_SOURCES`
    sources, for the browser's filter); `error` names a file that could not be read."""
    total, page, sources = 0, [], set()
    result: dict[str, Any] = {}
    try:
        for _, record in iter_records(path) if path else ():
            if isinstance(source := record.get("source"), str) and len(sources) < MAX_SOURCES:
                sources.add(source)
            if where.keep(record):
                if offset <= total < offset + limit:
                    page.append(record)
                total += 1
    except OSError as error:
        result["error"] = f"{path.name}: {error.strerror or error}"
    return {"total": total, "samples": page, "sources": sorted(sources), **result}
