"""An eval run's per-source summary and its filterable samples, from `summary.json` or the trace stream."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from tandem.dashboard.runs import read_jsonl
from tandem.eval.summary import summarize_source


def eval_summary(path: Path) -> dict[str, Any]:
    """`{"final": bool, "sources": {source: summary}}`: the written summary, or one computed from the traces so far."""
    try:
        return {"final": True, "sources": json.loads((path / "summary.json").read_text())["sources"]}
    except (OSError, ValueError, KeyError):
        pass
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in read_jsonl(path / "traces.jsonl"):
        by_source[record.get("source", "?")].append(record)
    sources = {}
    for source, records in by_source.items():
        per_task = Counter(r["task"]["id"] for r in records)
        sources[source] = summarize_source(
            records, expected=len(records), rollouts_per_task=max(per_task.values()), pass_threshold=1.0
        )
    return {"final": False, "sources": sources}


def eval_samples(
    path: Path,
    *,
    outcome: str | None = None,
    source: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    offset: int = 0,
    limit: int = 50,
) -> dict[str, Any]:
    """`{"total": matches, "samples": [...]}`, the trace records that pass every given filter."""

    def keep(record: dict[str, Any]) -> bool:
        reward = record.get("reward")
        if outcome and record.get("outcome") != outcome:
            return False
        if source and record.get("source") != source:
            return False
        if min_reward is not None and not (isinstance(reward, int | float) and reward >= min_reward):
            return False
        return max_reward is None or (isinstance(reward, int | float) and reward <= max_reward)

    matches = [record for record in read_jsonl(path / "traces.jsonl") if keep(record)]
    return {"total": len(matches), "samples": matches[offset : offset + limit]}
