"""Reading run directories without disturbing the jobs that write them.

Status rule: "finished" if an end marker exists (`summary.json` for an eval, `hf/final` for SFT, or the
last step reached `max_steps` from the run's TOML); else "running" if a metrics or traces file changed in
the last `RUNNING_WINDOW_S` seconds; else "failed".
"""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path
from typing import Any

RUNNING_WINDOW_S = 60.0
KINDS = ("rl", "sft", "eval", "trainer", "orchestrator", "inference")
DATA_FILES = ("metrics.jsonl", "orchestrator_metrics.jsonl", "traces.jsonl")

_cache: dict[Path, tuple[int, int, list[dict[str, Any]]]] = {}
"""path -> (inode, bytes of complete lines parsed, their records): a growing file is read from where it stopped."""


def _parse(lines: list[bytes]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of `path`; corrupt lines and a half-written last line are skipped.

    Only bytes appended since the last call are parsed; a replaced or truncated file is read again.
    """
    try:
        stat = path.stat()
    except FileNotFoundError:
        return []
    inode, offset, records = _cache.get(path, (stat.st_ino, 0, []))
    if inode != stat.st_ino or stat.st_size < offset:
        offset, records = 0, []
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
    complete, newline, tail = data.rpartition(b"\n")
    if newline:
        records = records + _parse(complete.split(b"\n"))
        offset += len(complete) + 1
    _cache[path] = (stat.st_ino, offset, records)
    return records + _parse([tail]) if tail.strip() else records


def downsample(records: list[Any], max_points: int) -> list[Any]:
    """At most `max_points` records by an even stride, always keeping the first and the last."""
    if max_points < 2 or len(records) <= max_points:
        return records if max_points >= 2 else records[-1:]
    stride = (len(records) - 1) / (max_points - 1)
    return [records[round(i * stride)] for i in range(max_points)]


def run_dir(outputs: Path, name: str) -> Path | None:
    """The run `name` if it is a direct child directory of `outputs` (no traversal), else None."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        return None
    path = outputs / name
    return path if path.is_dir() and path.parent.resolve() == outputs.resolve() else None


def run_kind(path: Path) -> str | None:
    return next((kind for kind in KINDS if (path / f"{kind}.toml").is_file()), None)


def _max_steps(path: Path, kind: str) -> int | None:
    try:
        config = tomllib.loads((path / f"{kind}.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    value = config.get("max_steps", config.get("trainer", {}).get("max_steps"))
    return value if isinstance(value, int) else None


def training_records(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path / "metrics.jsonl")


def orchestrator_records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-step records, online eval records) of `orchestrator_metrics.jsonl`."""
    records = read_jsonl(path / "orchestrator_metrics.jsonl")
    return [r for r in records if r.get("kind") != "eval"], [r for r in records if r.get("kind") == "eval"]


def run_status(path: Path, kind: str, steps: int, now: float | None = None) -> str:
    if kind == "eval":
        finished = (path / "summary.json").is_file()
    else:
        max_steps = _max_steps(path, kind)
        finished = (path / "hf" / "final").is_dir() or (max_steps is not None and steps >= max_steps)
    if finished:
        return "finished"
    mtimes = [p.stat().st_mtime for p in (path / name for name in DATA_FILES) if p.is_file()]
    recent = bool(mtimes) and (now or time.time()) - max(mtimes) < RUNNING_WINDOW_S
    return "running" if recent else "failed"


def describe(path: Path) -> dict[str, Any] | None:
    """One row of the run list, or None if `path` is not a tandem run."""
    kind = run_kind(path)
    if kind is None:
        return None
    last_reward = None
    if kind == "eval":
        traces = read_jsonl(path / "traces.jsonl")
        steps = len(traces)
        rewards = [t["reward"] for t in traces if isinstance(t.get("reward"), int | float)]
        last_reward = sum(rewards) / len(rewards) if rewards else None
    else:
        orchestrator, _ = orchestrator_records(path)
        trainer = training_records(path)
        steps = max((r.get("step", 0) for r in trainer + orchestrator), default=0)
        last_reward = orchestrator[-1].get("reward") if orchestrator else None
    return {
        "name": path.name,
        "kind": kind,
        "status": run_status(path, kind, steps),
        "started": (path / f"{kind}.toml").stat().st_mtime,
        "steps": steps,
        "last_reward": last_reward,
    }


def list_runs(outputs: Path) -> list[dict[str, Any]]:
    """Every run and eval directly under `outputs`, newest first."""
    if not outputs.is_dir():
        return []
    rows = [describe(path) for path in outputs.iterdir() if path.is_dir()]
    return sorted((row for row in rows if row), key=lambda row: row["started"], reverse=True)
