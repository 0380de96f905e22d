"""`tandem rl`: start inference, trainer and orchestrator as child processes of one command.

Each child gets its own resolved config file in the run directory (`inference.toml`,
`trainer.toml`, `orchestrator.toml`), its devices through CUDA_VISIBLE_DEVICES, and a log under
`logs/`. If any child fails, the others are stopped and the failing child's log tail is printed;
Ctrl-C stops everything. `--resume` restarts from the trainer's newest checkpoint: batches and
policies written after it are removed, so no step is lost or counted twice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError, to_toml
from tandem.config.rl import RlConfig
from tandem.run import atomic_write_text, prepare_run_dir
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


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
    """Wire the sections together: the server's address, the trainer's world size, resume points."""
    port = config.inference.port or _free_port()
    updates = {
        "inference": config.inference.model_copy(update={"port": port}),
        "orchestrator": config.orchestrator.model_copy(
            update={
                "trainer_ranks": config.deploy.trainer_nproc,
                "resume_step": resume_step,
                "inference": config.orchestrator.inference.model_copy(
                    update={"base_urls": [f"http://{config.inference.host}:{port}"]}
                ),
            }
        ),
    }
    if resume_step:
        updates["trainer"] = config.trainer.model_copy(
            update={"resume": config.trainer.resume.model_copy(update={"enabled": True, "step": resume_step})}
        )
    return config.model_copy(update=updates)


def _commands(config: RlConfig) -> dict[str, list[str]]:
    run_dir = config.run_dir
    files = {}
    for name in ("inference", "trainer", "orchestrator"):
        files[name] = run_dir / f"{name}.toml"
        atomic_write_text(files[name], to_toml(getattr(config, name)))
    python = [sys.executable, "-m"]
    trainer = [*python, "tandem", "trainer", "@", str(files["trainer"])]
    if config.deploy.trainer_nproc > 1:
        trainer = [*python, "torch.distributed.run", "--standalone", f"--nproc-per-node={config.deploy.trainer_nproc}"]
        trainer += ["-m", "tandem.trainer.rl", "@", str(files["trainer"])]
    return {
        "inference": [*python, "tandem", "inference", "@", str(files["inference"])],
        "trainer": trainer,
        "orchestrator": [*python, "tandem", "orchestrator", "@", str(files["orchestrator"])],
    }


def run_rl(config: RlConfig) -> int:
    """The `tandem rl` runner."""
    prepare_run_dir(config, "rl")
    resume_step = _resume_step(config) if config.resume.enabled else 0
    config = _configure(config, resume_step)
    commands = _commands(config)
    devices = {
        "inference": _devices(config.deploy.inference_gpus),
        "trainer": _devices(config.deploy.trainer_gpus),
        "orchestrator": {"CUDA_VISIBLE_DEVICES": ""},
    }
    children = [_start(name, commands[name], config.run_dir, devices[name]) for name in commands]
    progress = RlProgress(config, resume_step)
    try:
        while True:
            progress.refresh()
            failed = [c for c in children if c.process.poll() not in (None, 0)]
            if failed:
                child = failed[0]
                logger.error(
                    "%s exited with code %d; stopping the others. Its log:\n%s",
                    child.name,
                    child.process.returncode,
                    _tail(child.log),
                )
                return 1
            if all(c.process.poll() == 0 for c in children if c.name != "inference"):
                progress.refresh()
                logger.info("done: %d steps; policies in %s", config.max_steps, config.run_dir / "policies")
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping every process")
        return 130
    finally:
        progress.close()
        _stop(children)
