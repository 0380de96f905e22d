"""Find a taskset class by registered id ("gsm8k") or import path ("my_pkg.tasks:MyTaskset") and build it,
alone or as a config's environment source (`load_env`).

Ids map to import paths, so registering costs nothing until the taskset is used. An import path's module is
found by one rule in every command (`import_env_module`): the working directory first, then installed packages.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from tandem.config import ConfigError
from tandem.config.env import EnvConfig
from tandem.envs.base import Taskset, require_rewards
from tandem.envs.multiturn import MultiTurnTaskset
from tandem.envs.tool_env import ToolTaskset
from tandem.envs.verifiers import check_verifiers_env

_REGISTRY: dict[str, str] = {
    "reverse_text": "tandem.envs.builtin.reverse_text:ReverseText",
    "arithmetic": "tandem.envs.builtin.arithmetic:Arithmetic",
    "gsm8k": "tandem.envs.builtin.gsm8k:GSM8K",
    "guess_number": "tandem.envs.builtin.guess_number:GuessNumber",
    "calculator": "tandem.envs.builtin.calculator:Calculator",
    "count_shapes": "tandem.envs.builtin.count_shapes:CountShapes",
}


def register_taskset(taskset_id: str, target: str) -> None:
    """Make `taskset_id` name the taskset at import path `target` ("pkg.module:Class")."""
    if ":" in taskset_id:
        raise ValueError(f"taskset id {taskset_id!r} may not contain ':' (that marks an import path)")
    if _REGISTRY.get(taskset_id, target) != target:
        raise ValueError(f"taskset id {taskset_id!r} is already registered to {_REGISTRY[taskset_id]!r}")
    _REGISTRY[taskset_id] = target


def registered_tasksets() -> dict[str, str]:
    """Every registered id and its import path."""
    return dict(_REGISTRY)


def resolve_taskset(id_or_path: str) -> type[Taskset]:
    """The taskset class for a registered id or a "pkg.module:Class" path; errors name what was wrong."""
    if ":" in id_or_path:
        path = id_or_path
    elif id_or_path in _REGISTRY:
        path = _REGISTRY[id_or_path]
    else:
        close = difflib.get_close_matches(id_or_path, _REGISTRY, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown taskset id {id_or_path!r}; {hint}registered: {', '.join(sorted(_REGISTRY))}; "
            "or give an import path 'pkg.module:Class'"
        )
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"taskset import path {path!r} must look like 'pkg.module:Class'")
    module = import_env_module(module_name, id_or_path)
    cls = getattr(module, attr, None)
    if cls is None:
        raise ImportError(f"taskset {id_or_path!r}: module {module_name!r} has no attribute {attr!r}")
    if not (inspect.isclass(cls) and issubclass(cls, Taskset)) or inspect.isabstract(cls):
        raise TypeError(f"taskset {id_or_path!r}: {path!r} is not a concrete subclass of tandem.envs.Taskset")
    require_rewards(cls)
    return cls


def import_env_module(module_name: str, what: str | None = None) -> ModuleType:
    """Import the module of a taskset import path by the one rule every command follows (`tandem eval`,
    `tandem rl`, the orchestrator and trainer it starts): the working directory comes first on `sys.path`, then
    installed packages, as under `python -m`. So a one-file environment beside where the command runs
    (`my_envs.py`, id `my_envs:MyTaskset`) loads alike whether the process was started as a console script
    (whose `sys.path` lacks the working directory) or by `python -m`. A module that is not found names the
    rule and the directory."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name is not None and f"{module_name}.".startswith(f"{e.name}."):
            hint = (
                f" (an import path is looked up in the working directory {here} first, then in installed "
                "packages: run from the directory that holds it, `pip install` its package, or add its "
                "directory to PYTHONPATH)"
            )
        raise ImportError(f"taskset {what or module_name!r}: cannot import module {module_name!r}: {e}{hint}") from e


def _checked_class(id_or_path: str, args: dict[str, Any]) -> type[Taskset]:
    """The taskset class, its constructor shown to accept `args`."""
    cls = resolve_taskset(id_or_path)
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        accepted = ", ".join(inspect.signature(cls).parameters) or "no arguments"
        raise TypeError(f"taskset {id_or_path!r}: bad args {sorted(args)}: {e}; it takes: {accepted}") from None
    return cls


def load_taskset(id_or_path: str, **args: Any) -> Taskset:
    """Build the taskset named by id or import path with constructor `args` (checked before the call)."""
    return _checked_class(id_or_path, args)(**args)


def check_env(config: EnvConfig) -> None:
    """What `load_env` (or, for a verifiers source, `VerifiersEnv.load`) needs, checked without building the
    taskset (no data is read, nothing is generated): the id or import path resolves, the args fit the
    constructor, max_turns goes to a multi-turn taskset. A command calls it for every source before it starts
    anything; loading raises the same errors."""
    if config.verifiers is not None:
        check_verifiers_env(config)
        return
    _check_turns(_checked_class(config.id, config.args), config)


def _check_turns(cls: type[Taskset], config: EnvConfig) -> None:
    if config.max_turns is not None and not issubclass(cls, MultiTurnTaskset):
        raise ValueError(f"env {config.id!r}: max_turns is set but the taskset is single-turn")


def load_env(config: EnvConfig) -> Taskset:
    """Build the configured taskset with the config's rollout limits; select its tasks with `apply_select`.
    A tool taskset builds its tools once here, so a tool that cannot run on this machine (the `python` tool
    without a sandbox: `SandboxUnavailable`) stops the command at start-up, before any step."""
    if config.verifiers is not None:
        raise ValueError(f"env {config.id!r} is a verifiers environment: VerifiersEnv.load builds it")
    cls = _checked_class(config.id, config.args)
    _check_turns(cls, config)
    taskset = cls(**config.args)
    if config.timeout_s is not None:
        taskset.timeout_s = config.timeout_s
    if config.max_turns is not None:
        taskset.max_turns = config.max_turns
    if isinstance(taskset, ToolTaskset):
        taskset.tool_schemas()
    return taskset


@contextmanager
def source_errors(name: str) -> Iterator[None]:
    """What resolving, building or selecting source `name` raises (an unknown id, bad args, missing data) as a
    one-line ConfigError naming the source: every command reports a bad source the same way."""
    try:
        yield
    except (ValueError, TypeError, ImportError, OSError) as error:
        raise ConfigError(f"source {name!r}: {error}") from None
