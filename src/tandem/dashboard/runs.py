"""Reading run directories without disturbing the jobs that write them.

Every file the dashboard opens is named relative to a run and resolved first: a run whose real path is not
inside the outputs directory, or a file whose real path is not inside its run (a symlink pointing elsewhere),
is not read. Metrics files are followed as they grow (`tandem.jsonl.JsonlFollower`, one per file, kept between
requests) into a `Strided` sample of at most `STORED_POINTS` records, so memory is bounded however long a run
gets. A record that is not a JSON object is skipped and counted; values of the wrong type are ignored where a
number is needed, so one bad line or run never breaks a page.

Status rule: "finished" if an end marker exists (`summary.json` for an eval, `hf/final` for SFT, or the
last step reached `max_steps` from the run's TOML); else "stopped" if the run's own process recorded a clean stop
(`<kind>.stopped.json`, `tandem.run.records_clean_stop`: an inference server ended by SIGTERM or Ctrl-C); else
"running" if a data file (`DATA_FILES`; an inference server's heartbeat counts) changed in the last
`RUNNING_WINDOW_S` seconds; else "failed".
"""

from __future__ import annotations

import math
import threading
import time
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

from tandem.jsonl import JsonlFollower
from tandem.run import STOPPED_SUFFIX

RUNNING_WINDOW_S = 60.0
KINDS = ("rl", "sft", "eval", "trainer", "orchestrator", "inference")
DATA_FILES = ("metrics.jsonl", "orchestrator_metrics.jsonl", "traces.jsonl", "inference_metrics.jsonl")
MAX_CONFIG_BYTES = 1 << 20
"""A run's TOML larger than this is not parsed (tandem writes a few KiB): its status cannot use `max_steps`."""
STORED_POINTS = 4096
"""Records kept per metrics series (an even number): the most a chart can ask for."""
MAX_RESUMES = 256
"""Resume points kept per metrics file (a real run resumes a handful of times)."""


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a chart can plot and a sum can add."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def inside(base: Path, relative: str) -> Path | None:
    """The real path of `base / relative` if it exists and lies inside `base` (which must be real), else None."""
    try:
        real = (base / relative).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, unreadable, or a symlink loop
        return None
    return real if real.is_relative_to(base) else None


def downsample(records: list[Any], max_points: int) -> list[Any]:
    """At most `max_points` records by an even stride, always keeping the first and the last."""
    if max_points < 2 or len(records) <= max_points:
        return records if max_points >= 2 else records[-1:]
    stride = (len(records) - 1) / (max_points - 1)
    return [records[round(i * stride)] for i in range(max_points)]


class Strided:
    """An evenly strided sample of a growing sequence: every `stride`-th item from the first, at most `capacity`
    of them (when full, every other one is dropped and the stride doubles), plus always the latest item."""

    def __init__(self, capacity: int = STORED_POINTS):
        if capacity < 2 or capacity % 2:
            raise ValueError(f"capacity must be an even number >= 2, not {capacity}")
        self.capacity = capacity
        self.count = 0
        self.stride = 1
        self._kept: list[Any] = []
        self.last: Any = None

    def add(self, item: Any) -> None:
        if self.count % self.stride == 0:
            self._kept.append(item)
            if len(self._kept) > self.capacity:
                del self._kept[1::2]  # kept items are multiples of the stride; the even ones are of twice it
                self.stride *= 2
        self.count += 1
        self.last = item

    def items(self) -> list[Any]:
        if self.count == 0 or self._kept[-1] is self.last:
            return list(self._kept)
        return [*self._kept, self.last]


def staleness_mean(staleness: Any) -> float | None:
    """The mean version lag of a `{lag: count}` histogram; None if it is not one."""
    if not isinstance(staleness, dict):
        return None
    try:
        pairs = [(int(lag), count) for lag, count in staleness.items() if is_number(count)]
    except ValueError:
        return None
    total = sum(count for _, count in pairs)
    return sum(lag * count for lag, count in pairs) / total if total > 0 else None


class FollowedFile:
    """A JSONL file followed as it grows into what a subclass keeps of its records (`_add`). A file that is
    rewritten starts over (`_reset`); an unreadable one keeps what was read and says why (`error`)."""

    def __init__(self, path: Path):
        self.path = path
        self._follower = JsonlFollower(path)
        self.error: str | None = None
        self._reset()

    def _reset(self) -> None:
        raise NotImplementedError

    def _add(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def update(self) -> Self:
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

    def notes(self) -> list[str]:
        """What could not be read: the file itself, or lines that are not a JSON object."""
        notes = [self.error] if self.error else []
        if corrupt := self._follower.report.corrupt:
            notes.append(f"{self.path.name}: {corrupt} corrupt lines skipped")
        return notes


F = TypeVar("F", bound=FollowedFile)


class MetricsLog(FollowedFile):
    """A JSONL metrics file: its per-step records and its online eval records (`"kind": "eval"`), each a
    `Strided` sample.

    Values that need every record are derived as records arrive, before sampling drops any: the trainer's
    cumulative idle time (it logs `idle_s` per step), the inference servers' idle time per step (the orchestrator
    logs `inference_idle_s` cumulatively), the mean staleness, the heartbeat's `uptime_s`, and the steps the run
    resumed from (`resumed_from`, on the trainer's first record after a resume; the latest `MAX_RESUMES`).
    """

    def _reset(self) -> None:
        self.steps = Strided()
        self.evals = Strided()
        self.resumes: deque[int] = deque(maxlen=MAX_RESUMES)
        self.max_step = 0
        self._idle_total = 0.0
        self._inference_idle: float | None = None
        self._first_time: float | None = None

    def _add(self, record: dict[str, Any]) -> None:
        self._derive(record)
        (self.evals if record.get("kind") == "eval" else self.steps).add(record)

    def _derive(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if is_number(step):
            self.max_step = max(self.max_step, step)
        idle = record.get("idle_s")
        if is_number(idle):
            self._idle_total += idle
            record["idle_total_s"] = self._idle_total
        cumulative = record.get("inference_idle_s")
        if is_number(cumulative):
            previous = self._inference_idle
            fresh = previous is None or cumulative < previous  # the first record, or a restarted orchestrator
            record["inference_idle_step_s"] = cumulative if fresh else cumulative - previous
            self._inference_idle = cumulative
        if (mean := staleness_mean(record.get("staleness"))) is not None:
            record["staleness_mean"] = mean
        resumed = record.get("resumed_from")
        if is_number(resumed):
            self.resumes.append(resumed)
        now = record.get("time")
        if is_number(now):
            self._first_time = now if self._first_time is None else self._first_time
            record["uptime_s"] = now - self._first_time


@dataclass(frozen=True)
class Run:
    """A run directory: its name under the outputs directory, its real path (inside it) and its kind."""

    name: str
    path: Path
    kind: str

    def file(self, relative: str) -> Path | None:
        return inside(self.path, relative)


def run_kind(path: Path) -> str | None:
    """The kind of run `path` holds, from the `<kind>.toml` it has; None if it is not a tandem run."""
    return next((kind for kind in KINDS if (file := inside(path, f"{kind}.toml")) and file.is_file()), None)


def max_steps(run: Run) -> int | None:
    """`max_steps` (or `trainer.max_steps`) of the run's TOML; None if it has none or is not a readable config."""
    file = run.file(f"{run.kind}.toml")
    try:
        if file is None or file.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = tomllib.loads(file.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not TOML, nested past the stack
        return None
    trainer = config.get("trainer")
    value = config.get("max_steps", trainer.get("max_steps") if isinstance(trainer, dict) else None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime if path else None
    except OSError:
        return None


def run_status(run: Run, steps: int, now: float | None = None) -> str:
    if run.kind == "eval":
        finished = run.file("summary.json") is not None
    else:
        limit = max_steps(run)
        final = run.file("hf/final")
        finished = (final is not None and final.is_dir()) or (limit is not None and steps >= limit)
    if finished:
        return "finished"
    if run.file(f"{run.kind}{STOPPED_SUFFIX}") is not None:
        return "stopped"
    mtimes = [m for m in (mtime(run.file(name)) for name in DATA_FILES) if m is not None]
    recent = bool(mtimes) and (now or time.time()) - max(mtimes) < RUNNING_WINDOW_S
    return "running" if recent else "failed"


class Outputs:
    """The runs directly under an outputs directory, with the followers of their files kept between requests.

    The server runs handlers in a thread pool: a handler holds `lock` while it reads followed records.
    """

    def __init__(self, root: Path):
        self.root = root.resolve()
        self._followed: dict[Path, FollowedFile] = {}
        self.lock = threading.RLock()

    def run(self, name: str) -> Run | None:
        """The run `name` if it is a direct child of the outputs directory whose real path is inside it."""
        if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
            return None
        path = inside(self.root, name)
        if path is None or path == self.root or not path.is_dir():
            return None
        kind = run_kind(path)
        return Run(name, path, kind) if kind else None

    def runs(self) -> list[Run]:
        try:
            names = sorted(child.name for child in self.root.iterdir())
        except OSError:
            return []
        return [run for run in map(self.run, names) if run]

    def followed(self, run: Run, name: str, kind: type[F]) -> F | None:
        """The `kind` follower of the run's file `name` (None if it is missing or outside the run), brought up to
        date; one per file, kept between calls, so each call reads only what was appended since the last."""
        path = run.file(name)
        if path is None or not path.is_file():
            return None
        with self.lock:
            follower = self._followed.get(path)
            if not isinstance(follower, kind):
                follower = self._followed[path] = kind(path)
            return follower.update()

    def metrics(self, run: Run, name: str) -> MetricsLog | None:
        return self.followed(run, name, MetricsLog)

    def forget_missing(self, runs: list[Run]) -> None:
        """Drop the followers of files no longer in a listed run, so a deleted run frees its memory."""
        with self.lock:
            for path in list(self._followed):
                if not any(path.is_relative_to(run.path) for run in runs) or not path.is_file():
                    del self._followed[path]
