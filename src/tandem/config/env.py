"""The environment source block of eval and training configs: which taskset, built how, which of its tasks.

These are the config models only; `tandem.envs` builds the taskset (`load_env`) and picks its tasks
(`apply_select`). They sit here so that every config loads without importing environments. Task index
ranges are parsed when the config loads, so a bad range is a config error naming the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema

from tandem.config.base import Section


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


class VerifiersConfig(Section):
    """A verifiers (v1) environment: verifiers' own env config and the renderer its prompts are rendered with."""

    env: dict[str, Any] = Field(default_factory=dict)
    """verifiers' env config, as prime-rl's `env` table: `taskset` fields, each agent's `harness` and `runtime` (`agent = {harness = {id = "null"}, runtime = {type = "subprocess"}}`), `timeout`, `retries`; the taskset id is the source's `id`. verifiers validates it."""
    renderer: dict[str, Any] | None = None
    """A `renderers` RendererConfig (e.g. {name = "qwen3"}); unset: chosen from the model by renderers."""


class EnvConfig(Section):
    """An environment source: which taskset, built how, which of its tasks, and per-rollout limits."""

    id: str
    """Registered taskset id (e.g. "gsm8k") or import path "pkg.module:Class"; with `verifiers`, the verifiers taskset id (an installed package or a module on the path, as `vf-eval` takes it)."""
    verifiers: VerifiersConfig | None = None
    """Set (even empty: `verifiers = {}`) for a verifiers environment, loaded, selected and run by verifiers."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the taskset's constructor (e.g. {path = "test.jsonl"} for gsm8k)."""
    select: SelectConfig = Field(default_factory=SelectConfig)
    """Which tasks to use: include -> exclude -> shuffle -> skip -> limit."""
    timeout_s: float | None = Field(None, gt=0)
    """Seconds one rollout may take; unset keeps the taskset's own `timeout_s`."""
    max_turns: int | None = Field(None, ge=1)
    """Most model replies per rollout (multi-turn tasksets only); unset keeps the taskset's own."""


class SandboxConfig(Section):
    """The sandbox of the built-in `python` tool (`tandem.envs.sandbox`), for every run in this process."""

    unsafe_no_isolation: bool = False
    """Run model-written code without a sandbox where neither bubblewrap nor Linux namespaces are available (logged as a warning): the code can then read, write and reach whatever this process can, so only for code you trust. Otherwise such a machine refuses to start a run whose environment has the `python` tool."""
    max_concurrent: int | None = Field(None, ge=1)
    """Sandboxed runs at once in this process; more calls wait their turn (unset: min(CPU count, 8))."""
