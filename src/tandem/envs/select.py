"""The `select` block: which tasks of a taskset a run uses. Eval sources and training sources both call
`apply_select`, so the same block picks the same tasks in both.

Order is fixed: include -> exclude -> shuffle -> skip -> limit. The block itself is a config model
(`tandem.config.env.SelectConfig`), whose ranges are parsed when the config loads.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence

from tandem.config.env import SelectConfig, TaskFilter
from tandem.envs.base import Task, Taskset


class SelectError(ValueError):
    """A select block that cannot apply to this taskset (e.g. shuffling an infinite one)."""


class SelectWarning(UserWarning):
    """An include entry that matched no task."""


def _matches(task_filter: TaskFilter, task: Task) -> bool:
    """Whether `task` is one of the filter's idx ranges, ids or names."""
    return task.id in task_filter.ids or task.name in task_filter.names or any(task.idx in r for r in task_filter.idx)


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
    return (not select.include or _matches(select.include, task)) and not _matches(select.exclude, task)


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
