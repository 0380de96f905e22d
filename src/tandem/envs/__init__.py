"""Environments: task rows, reward functions, the select block, and built-in tasksets.

Eval and training both go through this package: `load_env(EnvConfig)` builds a
taskset, `apply_select` picks its tasks, `run_episode` rolls one out and scores it.
The source and select blocks are config models (`tandem.config.env`), exported here too.
See docs/environments.md.
"""

from tandem.config.env import EnvConfig, IdxRange, SelectConfig, TaskFilter, parse_idx
from tandem.envs.base import ROLLOUT_FIELDS, Message, Score, Task, Taskset, last_assistant_text, metric, reward
from tandem.envs.multiturn import ContextFull, Episode, Generate, MultiTurnTaskset, run_episode
from tandem.envs.numbers import extract_boxed, extract_final_number, find_numbers, normalize_number
from tandem.envs.registry import (
    check_env,
    load_env,
    load_taskset,
    register_taskset,
    registered_tasksets,
    resolve_taskset,
    source_errors,
)
from tandem.envs.select import SelectError, SelectWarning, apply_select
from tandem.envs.synthetic import SyntheticTaskset

__all__ = [
    "ROLLOUT_FIELDS",
    "ContextFull",
    "EnvConfig",
    "Episode",
    "Generate",
    "IdxRange",
    "Message",
    "MultiTurnTaskset",
    "Score",
    "SelectConfig",
    "SelectError",
    "SelectWarning",
    "SyntheticTaskset",
    "Task",
    "TaskFilter",
    "Taskset",
    "apply_select",
    "check_env",
    "extract_boxed",
    "extract_final_number",
    "find_numbers",
    "last_assistant_text",
    "load_env",
    "load_taskset",
    "metric",
    "normalize_number",
    "parse_idx",
    "register_taskset",
    "registered_tasksets",
    "resolve_taskset",
    "reward",
    "run_episode",
    "source_errors",
]
