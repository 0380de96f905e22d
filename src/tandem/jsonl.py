"""The one JSONL module: every per-line record file of a run (metrics, traces, samples) is read and written here.

A record counts once its newline is written. A process killed mid-write leaves at most a half-written last
line: readers ignore it and appenders cut it off before they append. A complete line that is not a JSON
object is corrupt: readers skip it and count it (`JsonlReport`) or, when strict, raise naming the line.
Reading streams the file in chunks, so memory is bounded by the records kept, not by the file's size.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tandem.files import atomic_write_text

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_sync = getattr(os, "fdatasync", os.fsync)
"""Flushes a file's data and size to disk: `fdatasync` skips the timestamps `fsync` also writes (macOS has
only `fsync`)."""


class CorruptLineError(ValueError):
    """A complete line that is not a JSON object, in a file read strictly."""


@dataclass
class JsonlReport:
    """What a read skipped: corrupt complete lines (1-based line numbers, the first few kept)."""

    corrupt: int = 0
    examples: list[int] = field(default_factory=list)

    def add(self, line_number: int) -> None:
        self.corrupt += 1
        if len(self.examples) < 5:
            self.examples.append(line_number)


def parse_line(line: bytes) -> dict[str, Any] | None:
    """The JSON object on one line, or None if the line is not one (blank lines are None too)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, nesting deeper than the stack
        return None
    return record if isinstance(record, dict) else None


def _complete_lines(handle: IO[bytes], offset: int) -> Iterator[tuple[int, bytes]]:
    """(end offset, line without its newline) for every complete line from `offset`, read in chunks."""
    handle.seek(offset)
    pending = b""
    while chunk := handle.read(_CHUNK):
        pending += chunk
        start = 0
        while (newline := pending.find(b"\n", start)) != -1:
            offset += newline + 1 - start
            yield offset, pending[start:newline]
            start = newline + 1
        pending = pending[start:]


def iter_records(
    path: Path, *, strict: bool = False, report: JsonlReport | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, record) for every complete JSON-object line of `path` (nothing if it is missing).

    Blank lines are skipped; a corrupt line raises `CorruptLineError` when `strict`, else it is skipped and
    counted in `report`.
    """
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return
    with handle:
        for number, (_, line) in enumerate(_complete_lines(handle, 0), start=1):
            record = parse_line(line)
            if record is not None:
                yield number, record
            elif line.strip():
                if strict:
                    raise CorruptLineError(f"{path}:{number}: not a JSON object line")
                if report is not None:
                    report.add(number)


def read_records(path: Path, *, strict: bool = False, report: JsonlReport | None = None) -> list[dict[str, Any]]:
    """Every complete JSON-object line of `path`, in order (see `iter_records`)."""
    return [record for _, record in iter_records(path, strict=strict, report=report)]


class JsonlFollower:
    """Reads the complete lines appended to a JSONL file since the last call; a half-written line waits.

    A file that shrinks or is replaced (a resumed run rewrites its metrics) is read again from its start:
    `new_records` then returns every record of the new file and sets `restarted`, so a caller that keeps
    records drops the old ones. Corrupt lines are skipped and counted in `report`.
    """

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.lines = 0
        self.inode: int | None = None
        self.restarted = False
        self.report = JsonlReport()

    def _restart(self) -> None:
        self.offset, self.lines, self.restarted, self.report = 0, 0, True, JsonlReport()

    def new_records(self) -> list[dict[str, Any]]:
        self.restarted = False
        try:
            handle = self.path.open("rb")
        except FileNotFoundError:
            if self.offset:
                self._restart()
                self.inode = None
            return []
        records = []
        with handle:
            stat = os.fstat(handle.fileno())
            if (self.inode is not None and stat.st_ino != self.inode) or stat.st_size < self.offset:
                self._restart()
            self.inode = stat.st_ino
            for end, line in _complete_lines(handle, self.offset):
                self.offset, self.lines = end, self.lines + 1
                record = parse_line(line)
                if record is not None:
                    records.append(record)
                elif line.strip():
                    self.report.add(self.lines)
        return records


def cut_partial_line(path: Path) -> None:
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


class JsonlWriter:
    """Appends records to a JSONL file, one line each, synced to disk before `write` returns.

    A record written before the machine crashed is there after it, like the checkpoint of its step. The sync
    is `_sync`, the cheapest call that keeps an append. Opening cuts a half-written last line
    (`cut_partial_line`); `truncate=True` starts the file empty.
    """

    def __init__(self, path: Path, *, truncate: bool = False) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if truncate:
            path.unlink(missing_ok=True)
        elif path.exists():
            cut_partial_line(path)
        self._file = open(path, "ab")  # noqa: SIM115 (closed by close() / the context manager)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self._file.flush()
        _sync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _ends_complete(path: Path) -> bool:
    """Whether the file is empty or ends with a newline (no half-written last line)."""
    with path.open("rb") as handle:
        if handle.seek(0, os.SEEK_END) == 0:
            return True
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def keep_steps_up_to(path: Path, step: int) -> None:
    """Rewrite a per-step JSONL file without the records past `step` (and any corrupt or half-written line),
    atomically, so a run resumed from step `step`'s checkpoint never counts a later step twice. A file with
    nothing to drop is left as it is, so a follower of it does not restart."""
    if not path.exists():
        return
    report = JsonlReport()
    records = read_records(path, report=report)
    kept = [record for record in records if record.get("step", 0) <= step]
    if len(kept) == len(records) and not report.corrupt and _ends_complete(path):
        return
    atomic_write_text(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in kept))
