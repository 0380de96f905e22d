"""The `select` block: which tasks of a taskset a run uses. Eval sources and training sources both call
`apply_select`, so the same block picks the same tasks in both.

Order is fixed: include -> exclude -> shuffle -> skip -> limit. Ranges are parsed
when the config loads, so a bad range is a config error naming the range.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema

from tandem.config.base import Section
from tandem.envs.base import Task, Taskset


class SelectError(ValueError):
    """A select block that cannot apply to this taskset (e.g. shuffling an infinite one)."""


class SelectWarning(UserWarning):
    """An include entry that matched no task."""


@dataclass(frozen=True)
class IdxRange:
    """Task indices `start, start+step, ...` below `stop` (no `stop`: unbounded)."""

    start: int
    stop: int | None = None
    step: int = 1

    def __contains__(self, idx: int) -> bool:
        return idx >= self.start and (self.stop is None or idx < self.stop) and (idx - self.start) % self.step == 0

    def __str__(self) -> str:
        if self.stop == self.start + 1:
            return str(self.start)
        stop = "" if self.stop is None else str(self.stop)
        return f"{self.start}:{stop}" + ("" if self.step == 1 else f":{self.step}")


def _parse_part(part: str) -> IdxRange:
    """One range: "7", "0:100", "0:100:2", "10:" (unbounded), "::3"."""
    try:
        fields = [int(f) if f.strip() else None for f in part.split(":")]
    except ValueError:
        fields = []
    if not 1 <= len(fields) <= 3 or (fields[0] is None and len(fields) == 1):
        raise ValueError(f"idx range {part!r} is not an integer or start:stop:step")
    if len(fields) == 1:
        fields.append(fields[0] + 1)
    start, stop, step = fields[0] or 0, fields[1], fields[2] if len(fields) == 3 else None
    step = 1 if step is None else step
    if start < 0 or (stop is not None and stop < 0):
        raise ValueError(f"idx range {part!r} is negative; idx counts from 0 in load order")
    if step <= 0:
        raise ValueError(f"idx range {part!r} has step {step}; the step must be positive")
    if stop is not None and stop <= start:
        raise ValueError(f"idx range {part!r} is empty (stop <= start)")
    return IdxRange(start, stop, step)


def parse_idx(value: Any) -> tuple[IdxRange, ...]:
    """An int, a string of comma-separated ranges ("0:10,20:30:2,42"), or a list mixing both ([] is none)."""
    if isinstance(value, IdxRange):
        return (value,)
    if isinstance(value, bool):  # a bool is an int to Python, never to a user
        raise ValueError(f"idx must be an integer or a range string, got {value!r}")
    if isinstance(value, int):
        return (_parse_part(str(value)),)
    if isinstance(value, str):
        return tuple(_parse_part(part.strip()) for part in value.split(","))
    if isinstance(value, list | tuple):
        return tuple(r for item in value for r in parse_idx(item))
    raise ValueError(f"idx must be an integer, a range string or a list of them, got {value!r}")


def _dump_range(r: IdxRange) -> int | str:
    """A single index as an int, anything else as its range string, so a dumped config loads back."""
    return r.start if r.stop == r.start + 1 else str(r)


IdxRanges = Annotated[
    tuple[IdxRange, ...],
    BeforeValidator(parse_idx),
    PlainSerializer(lambda ranges: [_dump_range(r) for r in ranges], return_type=list[int | str]),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "array"}]}),
]


class TaskFilter(Section):
    """Tasks matching any of the given idx ranges, ids or names."""

    idx: IdxRanges = ()
    """Load-order indices: 7, "0:100:2", "1,5,9", or a list such as [0, "10:20"]."""
    ids: tuple[str, ...] = ()
    """Task ids."""
    names: tuple[str, ...] = ()
    """Task names."""

    def __bool__(self) -> bool:
        return bool(self.idx or self.ids or self.names)

    def matches(self, task: Task) -> bool:
        return task.id in self.ids or task.name in self.names or any(task.idx in r for r in self.idx)

    def idx_bound(self) -> int | None:
        """One past the largest idx this filter can match, when it is only bounded idx ranges."""
        if self.ids or self.names or any(r.stop is None for r in self.idx):
            return None
        return max(r.stop for r in self.idx)  # type: ignore[type-var]


def _filter_shorthand(value: Any) -> Any:
    """`include = "0:100"` means `include.idx = "0:100"`."""
    return value if isinstance(value, dict | TaskFilter) else {"idx": value}


Filter = Annotated[TaskFilter, BeforeValidator(_filter_shorthand)]


class SelectConfig(Section):
    """Which tasks to use, applied in the order include -> exclude -> shuffle -> skip -> limit."""

    include: Filter = Field(default_factory=TaskFilter)
    """Keep only tasks matching these idx ranges, ids or names (a bare value means idx); unset keeps all."""
    exclude: Filter = Field(default_factory=TaskFilter)
    """Then drop tasks matching these idx ranges, ids or names (a bare value means idx)."""
    shuffle: bool = False
    """Then shuffle (finite tasksets only), with `seed`."""
    seed: int = 0
    """Seed of the shuffle."""
    skip: int = Field(0, ge=0)
    """Then drop this many tasks from the front."""
    limit: int | None = Field(None, ge=1)
    """Then keep at most this many tasks; bounds an infinite taskset."""


def _in_load_order(tasks: Iterable[Task]) -> Iterator[Task]:
    for position, task in enumerate(tasks):
        if task.idx != position:
            raise SelectError(f"task {task.id!r} has idx {task.idx} at position {position}; idx must be the load order")
        yield task


def _warn_unmatched(include: TaskFilter, tasks: Sequence[Task]) -> None:
    unmatched = [f"idx {r}" for r in include.idx if r.start >= len(tasks)]
    unmatched += [f"id {i!r}" for i in sorted(set(include.ids) - {t.id for t in tasks})]
    unmatched += [f"name {n!r}" for n in sorted(set(include.names) - {t.name for t in tasks})]
    if unmatched:
        warnings.warn(
            f"select.include matched no task for {', '.join(unmatched)} ({len(tasks)} tasks)",
            SelectWarning,
            stacklevel=4,
        )


def apply_select(source: Taskset | Iterable[Task], select: SelectConfig) -> list[Task] | Iterator[Task]:
    """The selected tasks: a list when the result is finite, else a lazy iterator (infinite, no limit).

    A Sequence source (or a Taskset whose `tasks()` returns one) is finite; any
    other iterable is treated as infinite, so shuffling it or including by id or
    name is an error, and a bounded include or a `limit` stops reading it.
    """
    rows = source.tasks() if isinstance(source, Taskset) else source
    if isinstance(rows, Sequence):
        return _select_finite(rows, select)
    return _select_infinite(rows, select)


def _keep(task: Task, select: SelectConfig) -> bool:
    return (not select.include or select.include.matches(task)) and not select.exclude.matches(task)


def _stop(select: SelectConfig) -> int | None:
    return None if select.limit is None else select.skip + select.limit


def _select_finite(rows: Sequence[Task], select: SelectConfig) -> list[Task]:
    tasks = list(_in_load_order(rows))
    if select.include:
        _warn_unmatched(select.include, tasks)
    tasks = [t for t in tasks if _keep(t, select)]
    if select.shuffle:
        random.Random(select.seed).shuffle(tasks)
    return tasks[select.skip : _stop(select)]


def _select_infinite(rows: Iterable[Task], select: SelectConfig) -> list[Task] | Iterator[Task]:
    if select.shuffle:
        raise SelectError(
            "select.shuffle needs a finite taskset; this one is infinite (give it a size, e.g. args.num_tasks)"
        )
    if select.include.ids or select.include.names:
        raise SelectError(
            "select.include by ids or names needs a finite taskset; on an infinite one it may never finish"
        )
    stream: Iterator[Task] = _in_load_order(rows)
    bound = select.include.idx_bound() if select.include else None
    if bound is not None:
        stream = itertools.takewhile(lambda t: t.idx < bound, stream)
    selected = itertools.islice((t for t in stream if _keep(t, select)), select.skip, _stop(select))
    return selected if _stop(select) is None and bound is None else list(selected)
