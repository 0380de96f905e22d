"""Tasks, tasksets and their rubric: what a task is and how a rollout of it is scored.

A taskset is one class that both yields task rows and scores rollouts of them,
so an environment is one small file. Reward functions and metrics are methods
marked with `@reward` / `@metric`; they name the rollout fields they need as
parameters (see `ROLLOUT_FIELDS`), may be sync or async, and are collected per
class when it is defined, so a misspelt parameter fails at import, not mid-run.
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

Message = dict[str, Any]
"""A chat message in OpenAI form: `{"role": ..., "content": ...}` plus optional tool fields."""

ROLLOUT_FIELDS = frozenset({"task", "answer", "info", "completion", "messages", "state"})
"""Parameter names a reward or metric function may ask for.

`task`: the Task; `answer` / `info`: its fields; `completion`: the text of the
last assistant message; `messages`: the whole conversation (prompt included);
`state`: the per-rollout dict from `Taskset.init_state` (multi-turn games keep
their progress there).
"""


class Task(BaseModel):
    """One serialisable task row. `idx` is the load-order index (0, 1, 2, ...) and never changes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    idx: int = Field(ge=0)
    """Position in load order; `select.include` / `exclude` ranges refer to it."""
    id: str = ""
    """Stable unique identifier (defaults to `str(idx)`); `select` can pick tasks by it."""
    name: str = ""
    """Human-readable label, not necessarily unique (a subset, an operation); `select` can pick by it."""
    prompt: str | list[Message]
    """The user prompt, or the full chat messages to send."""
    answer: str = ""
    """Reference answer, for reward functions."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Free-form JSON-serialisable extras (reference solution, game parameters...)."""

    @model_validator(mode="after")
    def _default_id(self) -> Task:
        if not self.id:
            object.__setattr__(self, "id", str(self.idx))
        return self

    def messages(self) -> list[Message]:
        """The prompt as chat messages (a string prompt becomes one user message)."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [dict(m) for m in self.prompt]


@dataclass(frozen=True)
class Score:
    """A rollout's scalar reward (weighted sum of reward functions) and every function's raw value."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _RubricFn:
    """A decorated method: its weight (0 for metrics) and the rollout fields it takes."""

    fn: Callable[..., Any]
    weight: float
    is_reward: bool
    params: tuple[str, ...]
    takes_all: bool

    @property
    def name(self) -> str:
        return self.fn.__name__

    async def __call__(self, taskset: Taskset, fields: dict[str, Any]) -> float:
        kwargs = fields if self.takes_all else {p: fields[p] for p in self.params}
        value = await maybe_await(self.fn(taskset, **kwargs))
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"{type(taskset).__name__}.{self.name} returned {value!r}; reward and metric functions return a number"
            ) from None


def _rubric_fn(fn: Callable[..., Any], weight: float, is_reward: bool) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # drop `self`
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    names = tuple(p.name for p in params if p.kind is not p.VAR_KEYWORD)
    unknown = [n for n in names if n not in ROLLOUT_FIELDS]
    if unknown or any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"{fn.__qualname__}: unknown parameter(s) {unknown or '*args'}; "
            f"reward/metric methods take (self, <any of {sorted(ROLLOUT_FIELDS)}>)"
        )
    fn._tandem_rubric = _RubricFn(fn, weight, is_reward, names, takes_all)  # type: ignore[attr-defined]
    return fn


def reward(fn: Callable[..., Any] | None = None, *, weight: float = 1.0) -> Any:
    """Mark a method as a reward function: `@reward` or `@reward(weight=0.5)`; the reward is the weighted sum."""
    if fn is None:
        return lambda f: _rubric_fn(f, weight, is_reward=True)
    return _rubric_fn(fn, weight, is_reward=True)


def metric(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method as a metric: computed and reported like a reward function, but weight 0."""
    return _rubric_fn(fn, 0.0, is_reward=False)


def last_assistant_text(messages: Sequence[Message]) -> str:
    """The text of the last assistant message ("" if none); multi-part content is joined."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, str):
                return content
            return "".join(part.get("text", "") for part in content)
    return ""


async def maybe_await(value: Any) -> Any:
    """Await `value` if it is awaitable: lets tasksets write sync or async hooks."""
    return await value if isinstance(value, Awaitable) else value


class Taskset(ABC):
    """Base of every environment: yields task rows and scores rollouts of them.

    Subclasses implement `tasks()` and declare at least one `@reward`. A finite
    taskset returns a Sequence (a list) from `tasks()`; an infinite or streaming
    one returns an Iterator, which `select` treats as unbounded. Constructor
    keyword arguments are the taskset's `args` in configs.
    """

    timeout_s: float | None = 300.0
    """Seconds one rollout (generation plus environment steps) may take; None disables it."""
    rubric: ClassVar[tuple[_RubricFn, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, _RubricFn] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                spec = getattr(value, "_tandem_rubric", None)
                if spec is not None:
                    found[attr] = spec
                else:
                    found.pop(attr, None)  # a plain override un-declares the inherited one
        cls.rubric = tuple(found.values())

    @abstractmethod
    def tasks(self) -> Sequence[Task] | Iterator[Task]:
        """All tasks in load order: a Sequence if finite, an Iterator if infinite."""

    def init_state(self, task: Task) -> dict[str, Any]:
        """Fresh per-rollout state (multi-turn games keep their progress here)."""
        return {}

    async def score(
        self, task: Task, completion: str | Sequence[Message], state: dict[str, Any] | None = None
    ) -> Score:
        """Score one rollout: `completion` is the model's text, or every message after the prompt."""
        require_rewards(type(self))
        after_prompt = (
            [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        )
        fields = {
            "task": task,
            "answer": task.answer,
            "info": task.info,
            "completion": last_assistant_text(after_prompt),
            "messages": task.messages() + after_prompt,
            "state": {} if state is None else state,
        }
        values = await asyncio.gather(*(fn(self, fields) for fn in self.rubric))
        total = sum(fn.weight * v for fn, v in zip(self.rubric, values, strict=True) if fn.is_reward)
        return Score(reward=total, metrics={fn.name: v for fn, v in zip(self.rubric, values, strict=True)})


def require_rewards(cls: type[Taskset]) -> None:
    """Fail loudly for a taskset that declares no `@reward` (it could never be trained on)."""
    if not any(fn.is_reward for fn in cls.rubric):
        raise TypeError(f"taskset {cls.__qualname__} declares no @reward method")
