"""The trace stream: append-only JSONL (`tandem.jsonl`), one finished rollout a line, flushed as it finishes.

Each record carries a `key`, a hash of (source, task id, rollout index), so a resumed run skips the keys
it finds and reruns the rest. Reading trusts nothing it did not write whole: a half-written last line is
ignored (and cut off by the next `JsonlWriter`), a line that is not a trace record is skipped, and a key
seen twice counts once, the first time, so no summary counts a rollout twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from tandem.eval.summary import OUTCOMES
from tandem.jsonl import JsonlReport, iter_records

logger = logging.getLogger(__name__)


def trace_key(source: str, task_id: str, rollout: int) -> str:
    """The stable key of rollout `rollout` of task `task_id` in source `source`."""
    return hashlib.sha256(json.dumps([source, task_id, rollout]).encode()).hexdigest()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_trace(record: dict[str, Any]) -> bool:
    """Whether `record` has the fields the summary and the progress read, with usable types."""
    task, tokens = record.get("task"), record.get("tokens")
    return (
        isinstance(record.get("key"), str)
        and isinstance(record.get("source"), str)
        and record.get("outcome") in OUTCOMES
        and _number(record.get("reward"))
        and _number(record.get("latency_s"))
        and isinstance(task, dict)
        and isinstance(task.get("id"), str)
        and isinstance(tokens, dict)
        and all(_number(tokens.get(kind)) for kind in ("prompt", "completion"))
    )


def _lines(numbers: list[int], count: int) -> str:
    """`3, 8, 9` for the lines skipped, the first five of `count`."""
    shown = ", ".join(map(str, numbers[:5]))
    return f"{shown}, ..." if count > 5 else shown


def read_traces(path: Path) -> list[dict[str, Any]]:
    """Every rollout in the stream once, in order (none if it does not exist yet).

    Corrupt lines (not JSON, or not a trace record) and repeated keys (a later line for a rollout already
    read) are skipped, and one warning names how many and which lines.
    """
    corrupt = JsonlReport()
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    repeated: list[int] = []
    for number, record in iter_records(path, report=corrupt):
        if not is_trace(record):
            corrupt.add(number)
        elif record["key"] in seen:
            repeated.append(number)
        else:
            seen.add(record["key"])
            records.append(record)
    if corrupt.corrupt:
        logger.warning(
            "%s: skipped %d corrupt line(s) (line %s)", path, corrupt.corrupt, _lines(corrupt.examples, corrupt.corrupt)
        )
    if repeated:
        logger.warning(
            "%s: skipped %d line(s) repeating a rollout already read (line %s); the first one counts",
            path,
            len(repeated),
            _lines(repeated, len(repeated)),
        )
    return records
