"""Seeded synthetic tasksets: task `idx` is a pure function of (seed, idx).

Each task draws from its own RNG seeded by the pair, so task 7 is the same
whether the taskset is finite or infinite and whatever `select` skips before it.
"""

from __future__ import annotations

import itertools
import random
from abc import abstractmethod
from collections.abc import Iterator, Sequence

from tandem.envs.base import Task, Taskset


class SyntheticTaskset(Taskset):
    """A taskset generated from a seed: infinite by default, or `num_tasks` long."""

    def __init__(self, seed: int = 0, num_tasks: int | None = None) -> None:
        if num_tasks is not None and num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1 (or unset for an infinite taskset), got {num_tasks}")
        self.seed = seed
        self.num_tasks = num_tasks

    @abstractmethod
    def make_task(self, idx: int, rng: random.Random) -> Task:
        """Build task `idx`, drawing every random choice from `rng`."""

    def task(self, idx: int) -> Task:
        """Task `idx`, deterministic given the seed (string seeds hash stably across runs)."""
        return self.make_task(idx, random.Random(f"{self.seed}:{idx}"))

    def tasks(self) -> Sequence[Task] | Iterator[Task]:
        if self.num_tasks is None:
            return map(self.task, itertools.count())
        return [self.task(i) for i in range(self.num_tasks)]
