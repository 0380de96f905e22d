"""`EnvConfig`: one environment source (taskset id, its args, select, rollout limits), shared by eval and training."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tandem.config.base import Section
from tandem.envs.base import Taskset
from tandem.envs.multiturn import MultiTurnTaskset
from tandem.envs.registry import load_taskset
from tandem.envs.select import SelectConfig


class EnvConfig(Section):
    """An environment source: which taskset, built how, which of its tasks, and per-rollout limits."""

    id: str
    """Registered taskset id (e.g. "gsm8k") or import path "pkg.module:Class"."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the taskset's constructor (e.g. {path = "test.jsonl"} for gsm8k)."""
    select: SelectConfig = Field(default_factory=SelectConfig)
    """Which tasks to use: include -> exclude -> shuffle -> skip -> limit."""
    timeout_s: float | None = Field(None, gt=0)
    """Seconds one rollout may take; unset keeps the taskset's own `timeout_s`."""
    max_turns: int | None = Field(None, ge=1)
    """Most model replies per rollout (multi-turn tasksets only); unset keeps the taskset's own."""


def load_env(config: EnvConfig) -> Taskset:
    """Build the configured taskset with the config's rollout limits; select its tasks with `apply_select`."""
    taskset = load_taskset(config.id, **config.args)
    if config.timeout_s is not None:
        taskset.timeout_s = config.timeout_s
    if config.max_turns is not None:
        if not isinstance(taskset, MultiTurnTaskset):
            raise ValueError(f"env {config.id!r}: max_turns is set but the taskset is single-turn")
        taskset.max_turns = config.max_turns
    return taskset
