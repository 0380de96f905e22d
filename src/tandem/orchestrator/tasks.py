"""Which task each new rollout group trains on: sources mixed by weight, each in its `select` order.

The draw is a pure function of (seed, draw count) and each source's cursor, so the sampler's
state is a few integers that the orchestrator checkpoints with every batch. Draws settle out of
order (groups finish when they finish, and a group may wait for a later batch), so a checkpoint is
a `DrawLedger` resume point: the sampler state at the first unsettled draw plus the settled draws
after it, which a resumed sampler skips.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.config import ConfigError
from tandem.config.orchestrator import OrchestratorConfig, TrainSourceConfig
from tandem.envs import Task, Taskset, apply_select, check_env, load_env, resolve_taskset, source_errors
from tandem.envs.sandbox import start_sandbox
from tandem.envs.tool_env import ToolTaskset
from tandem.envs.verifiers import VerifiersEnv


@dataclass
class TrainSource:
    """A training source being drawn from: its tasks in `select` order (or, for an infinite selection, a stream
    read lazily) and `cursor`, the tasks drawn so far, which the sampler's checkpointed state holds."""

    name: str
    config: TrainSourceConfig
    taskset: Taskset | VerifiersEnv
    tasks: Sequence[Task] | None  # finite: cycled; None: an infinite selection read lazily
    stream: Iterator[Task] | None = None
    cursor: int = 0  # tasks drawn so far

    def next_task(self) -> Task:
        if self.tasks is not None:
            task = self.tasks[self.cursor % len(self.tasks)]
        else:
            if self.stream is None:
                assert isinstance(self.taskset, Taskset)  # a verifiers source's selection is always finite
                self.stream = itertools.islice(iter(apply_select(self.taskset, self.config.select)), self.cursor, None)
            task = next(self.stream)
        self.cursor += 1
        return task


def _require_sources(configs: list[TrainSourceConfig]) -> None:
    if not configs:
        raise ConfigError("no training sources: add an [[orchestrator.source]] block with the env id")


def _name(configs: list[TrainSourceConfig], index: int) -> str:
    return f"{configs[index].id}#{index}" if len(configs) > 1 else configs[index].id


def check_sources(config: OrchestratorConfig) -> None:
    """ConfigError, one line naming the source (with a did-you-mean for a mistyped id), unless there is something
    to train on and every training and online eval source resolves (`check_env`) and can build its tools:
    `tandem rl` and `tandem orchestrator` check it before they start anything, `--dry-run` included."""
    _require_sources(config.source)
    named = [(_name(config.source, index), source) for index, source in enumerate(config.source)]
    every = [*named, *((source.name, source) for source in config.eval.source)]
    for name, source in every:
        with source_errors(name):
            check_env(source)
    _check_tools(config, [(name, source) for name, source in every if source.verifiers is None])


def _check_tools(config: OrchestratorConfig, sources: list[tuple[str, Any]]) -> None:
    """Build the tools of every tool source under the run's sandbox settings, so a tool that cannot run here (the
    `python` tool on a host without isolation and no opt-out: `SandboxUnavailable`, one line) stops the command
    before anything starts, not after the model has loaded. Only tool tasksets are built, and nothing is run."""
    tool_sources = [(name, source) for name, source in sources if issubclass(resolve_taskset(source.id), ToolTaskset)]
    if not tool_sources:
        return
    start_sandbox(config.sandbox)
    for name, source in tool_sources:
        with source_errors(name):
            load_env(source)


def load_sources(configs: list[TrainSourceConfig]) -> list[TrainSource]:
    _require_sources(configs)
    sources = []
    for index, config in enumerate(configs):
        name = _name(configs, index)
        with source_errors(name):
            taskset: Taskset | VerifiersEnv
            if config.verifiers is not None:
                taskset = VerifiersEnv.load(name, config)
                selected: list[Task] | Iterator[Task] = taskset.select(config.select)
            else:
                taskset = load_env(config)
                selected = apply_select(taskset, config.select)
            tasks = selected if isinstance(selected, list) else None
            if tasks is not None and not tasks:
                raise ValueError("its select picks no tasks")
        sources.append(TrainSource(name, config, taskset, tasks))
    return sources


@dataclass(frozen=True)
class Draw:
    """One draw of the sampler: its index (which seeds the rollouts), the task, and the sampler state before it."""

    index: int
    source: TrainSource
    task: Task
    state_before: dict[str, Any]


class TaskSampler:
    def __init__(self, sources: list[TrainSource], seed: int):
        self.sources, self.seed, self.draws = sources, seed, 0
        self.weights = [source.config.weight for source in sources]
        self.skip: set[int] = set()  # draws a resumed run already settled

    def next(self) -> Draw:
        """The next draw that is not already settled."""
        while True:
            state, index = self.state(), self.draws
            rng = random.Random(self.seed * 1_000_003 + index)
            self.draws += 1
            source = rng.choices(self.sources, weights=self.weights)[0] if len(self.sources) > 1 else self.sources[0]
            task = source.next_task()
            if index not in self.skip:
                return Draw(index, source, task, state)

    def state(self) -> dict:
        return {"draws": self.draws, "cursors": [source.cursor for source in self.sources]}

    def load_state(self, state: dict) -> None:
        self.draws = state["draws"]
        for source, cursor in zip(self.sources, state["cursors"], strict=True):
            source.cursor, source.stream = cursor, None

    def resume(self, point: dict[str, Any]) -> None:
        """Continue from a `DrawLedger.resume_point`: every unsettled draw is drawn again, settled ones never."""
        self.load_state(point["sampler"])
        self.skip = set(point["skip"])


@dataclass
class DrawLedger:
    """Which draws are still open: in flight, or scored and waiting for a batch that is not written yet.

    A draw settles when the batch it trains in is written or when it is dropped (error, timeout, stale, no
    signal). A run killed and resumed draws every open draw again, and no settled one: `open` keeps each
    open draw's sampler state from before it, so the resume point is the state at the first open draw.
    """

    open: dict[int, dict] = field(default_factory=dict)
    settled: set[int] = field(default_factory=set)  # settled draws after the first open one

    def opened(self, draw: Draw) -> None:
        self.open[draw.index] = draw.state_before

    def settle(self, draw: int) -> None:
        del self.open[draw]
        self.settled.add(draw)
        first = min(self.open, default=None)
        self.settled = {d for d in self.settled if first is not None and d > first}

    def resume_point(self, sampler: TaskSampler) -> dict[str, Any]:
        """Where a run resumed after this moment starts drawing, and which later draws it skips."""
        state = self.open[min(self.open)] if self.open else sampler.state()
        skip = sorted(d for d in self.settled | sampler.skip if d >= state["draws"])
        return {"sampler": state, "skip": skip}
