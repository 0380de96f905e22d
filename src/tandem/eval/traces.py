"""The trace stream: append-only JSONL, one finished rollout a line, flushed as it finishes.

Each record carries a `key`, a hash of (source, task id, rollout index), so a
resumed run skips the keys it finds and reruns the rest. A record counts once
its newline is written: a process killed mid-write leaves at most a
half-written last line, which the reader ignores and the writer cuts off
before it appends.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

_CHUNK = 1 << 16


def trace_key(source: str, task_id: str, rollout: int) -> str:
    """The stable key of rollout `rollout` of task `task_id` in source `source`."""
    return hashlib.sha256(json.dumps([source, task_id, rollout]).encode()).hexdigest()


def read_traces(path: Path) -> list[dict[str, Any]]:
    """Every complete record in the stream (none if it does not exist yet); a bad complete line is an error."""
    if not path.is_file():
        return []
    complete = path.read_bytes()
    complete = complete[: complete.rfind(b"\n") + 1]
    records = []
    for number, line in enumerate(complete.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON trace record ({error})") from None
    return records


def _cut_partial_line(path: Path) -> None:
    """Truncate the file after its last newline, dropping a line a killed writer left half-written."""
    with open(path, "r+b") as handle:
        end = handle.seek(0, os.SEEK_END)
        position, keep = end, 0
        while position > 0:
            size = min(_CHUNK, position)
            position -= size
            handle.seek(position)
            newline = handle.read(size).rfind(b"\n")
            if newline != -1:
                keep = position + newline + 1
                break
        if keep < end:
            handle.truncate(keep)


class TraceWriter:
    """Appends records to a trace stream; each `write` is one line, flushed before it returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _cut_partial_line(path)
        self._file = open(path, "ab")  # noqa: SIM115 (closed by close() / the context manager)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
