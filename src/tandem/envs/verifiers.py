"""verifiers (v1) environments as tandem sources: loaded, selected and run by verifiers itself.

A source with a `[verifiers]` table names a verifiers taskset by its `id` (an installed package, or a module on
the path, as `vf-eval` finds it) and carries the rest of verifiers' own env config (`env`: the taskset's fields,
each agent's harness and runtime, timeouts) and the `renderers` config its prompts are rendered with. Nothing
here reimplements verifiers: `resolve_env_config` and `load_environment` build the env, `Taskset.select` picks
the tasks (so tandem and `vf-eval` pick the same ones for the same `select`), and `Env.run_slot` runs each
episode in this process, its harness talking to a model endpoint through verifiers' interception server.

verifiers' subprocess runtime installs each harness program as a `uv` script. `uv_environment` points
`uv` at a wheelhouse made once, at install time (`tandem verifiers-wheels`), so that works on a machine that
reaches no package index at run time.

verifiers is an optional extra (`pip install 'tandem[verifiers]'`), imported only when such a source is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tandem.config.env import EnvConfig, IdxRange, SelectConfig, TaskFilter
from tandem.config.verifiers import VerifiersWheelsConfig
from tandem.envs.base import Task

logger = logging.getLogger(__name__)

WHEELS_ENV = "TANDEM_VERIFIERS_WHEELS"
DEFAULT_WHEELS = Path.home() / ".cache" / "tandem" / "verifiers-wheels"
"""Where `tandem verifiers-wheels` puts the harness programs' wheels unless `$TANDEM_VERIFIERS_WHEELS` says."""
GATEWAY_KEY_VAR = "TANDEM_GATEWAY_KEY"
EVAL_KEY_VAR = "TANDEM_EVAL_API_KEY"
"""The variables verifiers reads the endpoint's API key from: the orchestrator's gateway (which needs none) and
the server `tandem eval` evaluates."""


class VerifiersMissing(ImportError):
    """The verifiers extra is not installed."""


def import_verifiers() -> ModuleType:
    """`verifiers.v1`, or a one-line error saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise VerifiersMissing(
            f"a verifiers environment needs the verifiers extra ({error}): pip install 'tandem[verifiers]'"
        ) from None
    return vf


def wheels_dir() -> Path:
    return Path(os.environ.get(WHEELS_ENV) or DEFAULT_WHEELS)


def uv_environment(wheels: Path | None = None) -> dict[str, str]:
    """The variables verifiers' `uv sync --script` installs each harness program under: compiled to bytecode at
    install (a program starts once per rollout, and importing openai and mcp from source costs it a second or
    two of CPU where bytecode is not written at run time), and, with a wheelhouse, from it alone (no index, no
    Python download), with this environment's `uv` on PATH. A variable the user set keeps its value."""
    wheels = wheels or wheels_dir()
    wanted = {"UV_COMPILE_BYTECODE": "1"}
    if wheels.is_dir() and any(wheels.glob("*.whl")):
        wanted |= _offline(wheels)
    found = {key: value for key, value in wanted.items() if key not in os.environ}
    if "UV_FIND_LINKS" in wanted and shutil.which("uv") is None:  # pip put `uv` beside this interpreter
        found["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return found


def _offline(wheels: Path) -> dict[str, str]:
    # `uv sync --script` has no variable for --no-index: the default index becomes the wheelhouse directory, which
    # as an index lists no project, so every package comes from it as find-links and uv never leaves the machine.
    # This interpreter runs the programs: the wheelhouse's binary wheels were downloaded for it.
    return {
        "UV_DEFAULT_INDEX": wheels.resolve().as_uri(),
        "UV_FIND_LINKS": str(wheels),
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_PYTHON": sys.executable,
    }


def harness_requirements() -> list[str]:
    """The packages verifiers' chat program (the `null` harness, and every harness built on it) installs as a
    `uv` script: its PEP 723 `dependencies`."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    block = re.search(r"^# dependencies = (\[.*\])$", CHAT_PROGRAM_SOURCE, re.MULTILINE)
    if block is None:
        raise RuntimeError("verifiers' chat program declares no PEP 723 dependencies")
    return re.findall(r'"([^"]+)"', block.group(1))


def build_wheelhouse(config: VerifiersWheelsConfig) -> int:
    """`tandem verifiers-wheels`: pip downloads the harness programs' requirements (and their dependencies) as
    wheels for this interpreter into the wheelhouse."""
    import_verifiers()
    target = Path(config.dir) if config.dir else wheels_dir()
    target.mkdir(parents=True, exist_ok=True)
    requirements = [*harness_requirements(), *config.requirements]
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(target), *requirements]
    logger.info("downloading %s into %s", ", ".join(requirements), target)
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        logger.error("pip download failed (exit %d): %s", done.returncode, " ".join(command))
        return done.returncode
    logger.info(
        "%d wheels in %s; verifiers environments now install their harnesses from there",
        len(list(target.glob("*.whl"))),
        target,
    )
    if config.dir:
        logger.info("runs read it from $%s=%s", WHEELS_ENV, target)
    return 0


def _vf_match(filter_: TaskFilter) -> dict[str, Any]:
    return {"idx": [_vf_range(r) for r in filter_.idx], "ids": list(filter_.ids), "names": list(filter_.names)}


def _vf_range(r: IdxRange) -> int | str:
    if r.stop == r.start + 1:
        return r.start
    return f"{r.start}:{'' if r.stop is None else r.stop}:{r.step}"


def vf_select(select: SelectConfig) -> Any:
    """tandem's `select` as verifiers' `SelectConfig`: the same fields, applied in the same order."""
    vf = import_verifiers()
    return vf.SelectConfig(
        include=_vf_match(select.include),
        exclude=_vf_match(select.exclude),
        shuffle=select.shuffle,
        seed=select.seed,
        skip=select.skip,
        limit=select.limit,
    )


def env_data(config: EnvConfig) -> dict[str, Any]:
    """The verifiers env config of a source: its `verifiers.env` table with the source's `id` as the taskset id
    (a different `taskset.id` there is an error) and its `timeout_s` as the episode deadline."""
    assert config.verifiers is not None
    data = dict(config.verifiers.env)
    taskset = dict(data.get("taskset") or {})
    if taskset.get("id", config.id) != config.id:
        raise ValueError(f"verifiers.env.taskset.id {taskset['id']!r} differs from the source id {config.id!r}")
    data["taskset"] = {**taskset, "id": config.id}
    if config.timeout_s is not None:
        data["timeout"] = {**dict(data.get("timeout") or {}), "episode": config.timeout_s}
    return data


def check_verifiers_env(config: EnvConfig) -> None:
    """What `VerifiersEnv.load` needs, checked before anything starts: the extra is installed, the taskset id
    imports, and verifiers accepts the env config; only tandem's native fields verifiers has no use for are
    refused (args, max_turns: verifiers' own taskset and agent fields say those)."""
    if config.args:
        raise ValueError("args: a verifiers taskset takes its fields in verifiers.env.taskset")
    if config.max_turns is not None:
        raise ValueError("max_turns: a verifiers agent takes it in verifiers.env.<agent>.max_turns")
    vf = import_verifiers()
    vf.resolve_env_config(env_data(config))


@dataclass
class VerifiersEnv:
    """A loaded verifiers env and the tasks its `select` picked, each also as a tandem `Task` (for the draw
    sampler, records and the dashboard) whose `idx` finds the verifiers task again."""

    name: str
    env: Any  # verifiers.v1.Env
    renderer: dict[str, Any] | None
    timeout_s: float | None
    _tasks: dict[int, Any]

    @classmethod
    def load(cls, name: str, config: EnvConfig) -> VerifiersEnv:
        check_verifiers_env(config)
        vf = import_verifiers()
        os.environ.update(uv_environment())  # the harness programs' runtimes inherit this process's
        env = vf.load_environment(vf.resolve_env_config(env_data(config)))
        launchable_toolsets(env)
        assert config.verifiers is not None
        return cls(name, env, config.verifiers.renderer, config.timeout_s, {})

    def select(self, select: SelectConfig) -> list[Task]:
        """The tasks `select` picks, by verifiers' `Taskset.select` (in its order); an infinite taskset must be
        bounded by the selection."""
        view = self.env.taskset.select(vf_select(select))
        if not view.bounded:
            raise ValueError("the taskset is infinite: bound it with select.limit or closed select.include.idx")
        chosen = list(view)
        self._tasks.update({task.data.idx: task for task in chosen})
        return [_as_task(task) for task in chosen]

    def verifiers_task(self, task: Task) -> Any:
        return self._tasks[task.idx]

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """verifiers' serving resources (shared tool servers, the interception server) for the run."""
        async with self.env.serving():
            yield

    def train_context(self, base_url: str, model: str, renderer_model: str, sampling: dict[str, Any]) -> Any:
        """What a training episode samples from: the token route at `base_url` through verifiers' train client
        (prompts rendered by `renderers` for `renderer_model`, tokens and logprobs back), with `sampling`."""
        from verifiers.v1.configs.client import TrainClientConfig

        client = TrainClientConfig(
            base_url=base_url,
            api_key_var=GATEWAY_KEY_VAR,
            renderer=self.renderer,
            renderer_model_name=renderer_model,
        )
        return self._context(client, model, sampling)

    def eval_context(self, base_url: str, model: str, sampling: dict[str, Any], api_key: str | None) -> Any:
        """What an evaluated episode samples from: the chat completions of the OpenAI-compatible server at
        `base_url`, through verifiers' eval client, as `vf-eval` samples (`api_key` is its bearer token)."""
        from verifiers.v1.configs.client import EvalClientConfig

        os.environ[EVAL_KEY_VAR] = api_key or "EMPTY"  # verifiers reads the key from a variable it names
        return self._context(EvalClientConfig(base_url=base_url, api_key_var=EVAL_KEY_VAR), model, sampling)

    @staticmethod
    def _context(client: Any, model: str, sampling: dict[str, Any]) -> Any:
        vf = import_verifiers()
        return vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig(**sampling))

    async def episodes(self, task: Task, contexts: Sequence[Any]) -> list[Any]:
        """One verifiers episode of `task` per model context, concurrently (inside `serving`)."""
        vf_task = self.verifiers_task(task)
        slots = self.env.slots(vf_task, len(contexts))
        return list(await asyncio.gather(*(self.env.run_slot(s, c) for s, c in zip(slots, contexts, strict=True))))


def launchable_toolsets(env: Any) -> None:
    """Make sure verifiers can start each of the env's tool servers: it runs a `Toolset` as `python -m <its
    module>` in a child process (in the runtime's own working directory), so the module must be importable there
    and start the server when run. The directory it was imported from goes onto `PYTHONPATH` (a one-file env
    beside the command, found through the working directory, would otherwise be missing there); a module that
    does not start its server is a one-line error now, not a tool server verifiers waits minutes for per
    rollout."""
    taskset = env.taskset
    toolsets = [*type(taskset).task_type().toolsets(taskset.config.task), *taskset.toolsets(taskset.config)]
    for toolset in toolsets:
        module = sys.modules[type(toolset).__module__]
        source = Path(module.__file__ or "")
        if "__main__" not in source.read_text():
            name = type(toolset).__name__
            raise ValueError(
                f"toolset {name}: verifiers starts it as `python -m {module.__name__}`, which runs nothing; end "
                f'{source.name} with `if __name__ == "__main__": {name}.run()`'
            )
        root = source.parents[module.__name__.count(".") + (source.name == "__init__.py")]
        if not {"site-packages", "dist-packages"} & set(root.parts):  # installed: on the child's path already
            _on_pythonpath(root)


def _on_pythonpath(directory: Path) -> None:
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if str(directory) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(directory), *entries])


def _as_task(task: Any) -> Task:
    data = task.data
    return Task(idx=data.idx, id=data.id or str(data.idx), name=data.name or "", prompt=data.prompt_text)
