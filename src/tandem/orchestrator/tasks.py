"""Which task each new rollout group trains on: sources mixed by weight, each in its `select` order.

The draw is a pure function of (seed, draw count) and each source's cursor, so the sampler's
state is a few integers that the orchestrator checkpoints with every batch.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tandem.config.orchestrator import TrainSourceConfig
from tandem.envs import Task, Taskset, apply_select
from tandem.envs.config import load_env


@dataclass
class Source:
    name: str
    config: TrainSourceConfig
    taskset: Taskset
    tasks: Sequence[Task] | None  # finite: cycled; None: an infinite selection read lazily
    stream: Iterator[Task] | None = None
    cursor: int = 0  # tasks drawn so far

    def next_task(self) -> Task:
        if self.tasks is not None:
            task = self.tasks[self.cursor % len(self.tasks)]
        else:
            if self.stream is None:
                self.stream = itertools.islice(iter(apply_select(self.taskset, self.config.select)), self.cursor, None)
            task = next(self.stream)
        self.cursor += 1
        return task


def load_sources(configs: list[TrainSourceConfig]) -> list[Source]:
    if not configs:
        raise ValueError("no training sources: add an [[orchestrator.source]] block with the env id")
    sources = []
    for index, config in enumerate(configs):
        taskset = load_env(config)
        selected = apply_select(taskset, config.select)
        tasks = selected if isinstance(selected, list) else None
        if tasks is not None and not tasks:
            raise ValueError(f"source {index} ({config.id}) selects no tasks")
        sources.append(Source(f"{config.id}#{index}" if len(configs) > 1 else config.id, config, taskset, tasks))
    return sources


class TaskSampler:
    def __init__(self, sources: list[Source], seed: int):
        self.sources, self.seed, self.draws = sources, seed, 0
        self.weights = [source.config.weight for source in sources]

    def next(self) -> tuple[Source, Task]:
        rng = random.Random(self.seed * 1_000_003 + self.draws)
        self.draws += 1
        source = rng.choices(self.sources, weights=self.weights)[0] if len(self.sources) > 1 else self.sources[0]
        return source, source.next_task()

    def state(self) -> dict:
        return {"draws": self.draws, "cursors": [source.cursor for source in self.sources]}

    def load_state(self, state: dict) -> None:
        self.draws = state["draws"]
        for source, cursor in zip(self.sources, state["cursors"], strict=True):
            source.cursor, source.stream = cursor, None
