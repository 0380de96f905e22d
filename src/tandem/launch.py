"""`tandem rl`: start inference, trainer and orchestrator as child processes of one command.

Each child gets its own resolved config file in the run directory (`inference.toml`,
`trainer.toml`, `orchestrator.toml`), its devices through CUDA_VISIBLE_DEVICES, and a log under
`logs/`. If any child fails, the others are stopped and the failing child's log tail is printed;
Ctrl-C stops everything. `--resume` restarts from the trainer's newest checkpoint: batches and
policies written after it are removed, so no step is lost or counted twice.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError, to_toml
from tandem.config.rl import RlConfig
from tandem.run import atomic_write_text, log_tail, prepare_run_dir
from tandem.trainer.ckpt import list_checkpoints
from tandem.transport.batches import batch_path
from tandem.transport.policies import policy_dir
from tandem.view import RlProgress

logger = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path


def _devices(gpus: list[int]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a child; on CPU, one thread each so three processes do not oversubscribe."""
    if gpus:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    return {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}


def _start(name: str, command: list[str], run_dir: Path, env: dict[str, str]) -> Child:
    log = run_dir / "logs" / f"{name}.stderr.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("w")
    process = subprocess.Popen(
        command,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    logger.info("started %s (pid %d): %s", name, process.pid, " ".join(command))
    return Child(name, process, log)


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when `tandem rl` dies, even by SIGKILL, so no server is left running."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(children: list[Child], timeout_s: float = 30.0) -> None:
    for child in children:
        if child.process.poll() is None:
            os.killpg(child.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()


def _resume_step(config: RlConfig) -> int:
    """The trainer checkpoint to continue from; drop what was produced after it."""
    checkpoints = list_checkpoints(config.run_dir / "checkpoints")
    if not checkpoints:
        raise ConfigError(f"nothing to resume: no complete trainer checkpoint under {config.run_dir / 'checkpoints'}")
    step = config.resume.step if config.resume.step is not None else max(checkpoints)
    if step not in checkpoints:
        raise ConfigError(f"no trainer checkpoint for step {step}; found {sorted(checkpoints)}")
    for later in range(step + 1, config.max_steps + 1):
        batch_path(config.run_dir / "batches", later).unlink(missing_ok=True)
        shutil.rmtree(policy_dir(config.run_dir / "policies", later), ignore_errors=True)
    return step


def _configure(config: RlConfig, resume_step: int) -> RlConfig:
    """Wire the sections together: the trainer's world size and the resume points."""
    updates = {
        "orchestrator": config.orchestrator.model_copy(
            update={"trainer_ranks": config.deploy.trainer_nproc, "resume_step": resume_step}
        ),
    }
    if resume_step:
        updates["trainer"] = config.trainer.model_copy(
            update={"resume": config.trainer.resume.model_copy(update={"enabled": True, "step": resume_step})}
        )
    return config.model_copy(update=updates)


def _with_server(config: RlConfig, url: str) -> RlConfig:
    pool = config.orchestrator.inference.model_copy(update={"base_urls": [url]})
    return config.model_copy(update={"orchestrator": config.orchestrator.model_copy(update={"inference": pool})})


def _command(name: str, config: RlConfig) -> list[str]:
    """Write the process's resolved config next to the others and return the command that runs it."""
    file = config.run_dir / f"{name}.toml"
    atomic_write_text(file, to_toml(getattr(config, name)))
    python = [sys.executable, "-m"]
    if name == "trainer" and config.deploy.trainer_nproc > 1:
        launcher = [*python, "torch.distributed.run", "--standalone", f"--nproc-per-node={config.deploy.trainer_nproc}"]
        return [*launcher, "-m", "tandem.trainer.rl", "@", str(file)]
    return [*python, "tandem", name, "@", str(file)]


def _wait_for_server(path: Path, server: Child, timeout_s: float) -> str:
    """The URL the inference server announces in `server.json` once it listens (it may pick its port)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if server.process.poll() is not None:
            raise ChildFailed(server)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the inference server wrote no {path} within {timeout_s:.0f}s; see {server.log}")
        time.sleep(0.1)
    return json.loads(path.read_text())["url"]


class ChildFailed(RuntimeError):
    def __init__(self, child: Child):
        self.child = child
        super().__init__(child.name)


def run_rl(config: RlConfig) -> int:
    """The `tandem rl` runner."""
    prepare_run_dir(config, "rl")
    resume_step = _resume_step(config) if config.resume.enabled else 0
    config = _configure(config, resume_step)
    (config.run_dir / "server.json").unlink(missing_ok=True)  # left by an earlier, killed run
    devices = {
        "inference": _devices(config.deploy.inference_gpus),
        "trainer": _devices(config.deploy.trainer_gpus),
        "orchestrator": {"CUDA_VISIBLE_DEVICES": ""},
    }
    children: list[Child] = []
    progress = None
    try:
        for name in ("inference", "trainer"):
            children.append(_start(name, _command(name, config), config.run_dir, devices[name]))
        url = _wait_for_server(
            config.run_dir / "server.json", children[0], config.orchestrator.inference.startup_timeout_s
        )
        config = _with_server(config, url)
        children.append(
            _start("orchestrator", _command("orchestrator", config), config.run_dir, devices["orchestrator"])
        )
        progress = RlProgress(config, resume_step)
        while True:
            progress.refresh()
            failed = next((c for c in children if c.process.poll() not in (None, 0)), None)
            if failed is not None:
                raise ChildFailed(failed)
            if all(c.process.poll() == 0 for c in children if c.name != "inference"):
                progress.refresh()
                logger.info("done: %d steps; policies in %s", config.max_steps, config.run_dir / "policies")
                return 0
            time.sleep(0.2)
    except ChildFailed as error:
        child = error.child
        logger.error(
            "%s exited with code %d; stopping the others. Its log:\n%s",
            child.name,
            child.process.returncode,
            log_tail(child.log),
        )
        return 1
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping every process")
        return 130
    finally:
        if progress is not None:
            progress.close()
        _stop(children)
