"""`tandem rl`: start inference, trainer and orchestrator as child processes of one command.

Each child gets its own resolved config file in the run directory (`inference.toml`, or
`inference-<k>.toml` for each of several servers, `trainer.toml`, `orchestrator.toml`), its devices
through CUDA_VISIBLE_DEVICES (`child_envs`), and a log under `logs/`. The servers and the orchestrator also get
the run's admin token (`run_admin_token`) in their environment, the one place no other process on the host (a
sandboxed tool call included) can read it from: not a command line, nor a file in the run directory. If any
child fails, the others are stopped and the failing child's log tail is printed; Ctrl-C stops everything. `--resume` restarts from the trainer's newest checkpoint: batches and
policies written after it are removed, and the per-step record files (`STEP_FILES`) are cut back to it
before any child starts, so no step is lost or counted twice and nothing reads a file being rewritten.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.checkpoints import checkpoints_root
from tandem.config import RunConfig, to_toml
from tandem.config.inference import InferenceConfig
from tandem.config.rl import RlConfig, RlDeployConfig
from tandem.files import atomic_write_text
from tandem.jsonl import keep_steps_up_to
from tandem.net import ADMIN_TOKEN_ENV, admin_token, is_loopback
from tandem.orchestrator.main import PER_STEP_FILES
from tandem.orchestrator.tasks import check_sources
from tandem.run import claim_run_dir, log_tail, prepare_run_dir
from tandem.shared_gpu import split_shared_gpu
from tandem.trainer.ckpt import resolve_resume
from tandem.trainer.model import read_model_args
from tandem.transport.batches import batch_path
from tandem.transport.policies import policy_dir
from tandem.transport.weights.control import announce_path
from tandem.view import RlProgress

logger = logging.getLogger(__name__)

STEP_FILES = ("metrics.jsonl", *PER_STEP_FILES)  # the trainer's and the orchestrator's per-step JSONL records


@dataclass
class LaunchedChild:
    """A process the launcher started and supervises: its name in logs, the process, and its log file."""

    name: str
    process: subprocess.Popen
    log: Path


def server_names(deploy: RlDeployConfig) -> list[str]:
    """The inference children: `inference`, or `inference-0` ... `inference-<K-1>` for K servers."""
    if deploy.inference_servers == 1:
        return ["inference"]
    return [f"inference-{k}" for k in range(deploy.inference_servers)]


def child_envs(deploy: RlDeployConfig, environ: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The environment each child adds to ours: which GPUs it sees (CUDA_VISIBLE_DEVICES), and on CPU one thread
    each, so that the processes do not oversubscribe the cores.

    The trainer sees `trainer_gpus` and server k the k-th equal slice of `inference_gpus`. A side left empty sees
    no GPU when the other side has some (it runs on CPU), and every GPU when neither has any (both share them).
    The orchestrator never sees a GPU."""
    environ = os.environ if environ is None else environ
    split = bool(deploy.trainer_gpus or deploy.inference_gpus)

    def visible(gpus: list[int]) -> dict[str, str]:
        if gpus:
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        devices = {"CUDA_VISIBLE_DEVICES": ""} if split else {}
        return devices if devices or "OMP_NUM_THREADS" in environ else {"OMP_NUM_THREADS": "1"}

    per_server = len(deploy.inference_gpus) // deploy.inference_servers
    envs = {"trainer": visible(deploy.trainer_gpus), "orchestrator": {"CUDA_VISIBLE_DEVICES": ""}}
    for k, name in enumerate(server_names(deploy)):
        envs[name] = visible(deploy.inference_gpus[k * per_server : (k + 1) * per_server])
    return envs


def run_admin_token(config: RlConfig) -> str:
    """The bearer token the run's servers require on their admin routes (/pause, /update_weights, /resume,
    /weights/join) and the orchestrator sends: the one configured (`inference.admin_token`, the same
    `orchestrator.inference.admin_token`, or $TANDEM_ADMIN_TOKEN), else a random one for this run, so that nothing
    else on the host can pause the servers or replace the policy being trained."""
    configured = config.inference.admin_token or config.orchestrator.inference.admin_token
    return admin_token(configured) or secrets.token_urlsafe(32)


def _without_admin_tokens(config: RlConfig) -> RlConfig:
    """`config` with no admin token in it: the config files written into the run directory never hold one."""
    pool = config.orchestrator.inference.model_copy(update={"admin_token": None})
    orchestrator = config.orchestrator.model_copy(update={"inference": pool})
    inference = config.inference.model_copy(update={"admin_token": None})
    return config.model_copy(update={"orchestrator": orchestrator, "inference": inference})


def _start(name: str, command: list[str], run_dir: Path, env: dict[str, str]) -> LaunchedChild:
    """Start child `name` with `env` added to our environment, less any admin token (`env` gives it to the children
    that call or serve admin routes)."""
    log = run_dir / "logs" / f"{name}.stderr.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("w")
    inherited = {key: value for key, value in os.environ.items() if key != ADMIN_TOKEN_ENV}
    process = subprocess.Popen(
        command,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**inherited, **env},
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    logger.info("started %s (pid %d): %s", name, process.pid, " ".join(command))
    return LaunchedChild(name, process, log)


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when `tandem rl` dies, even by SIGKILL, so no server is left running."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(children: list[LaunchedChild], timeout_s: float = 30.0) -> None:
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
    """The trainer checkpoint to continue from (the given step's, else the newest intact one, verified against its
    manifest); drop what was produced after it."""
    interval = ("trainer.ckpt.interval", config.trainer.ckpt.interval)
    step, _ = resolve_resume(checkpoints_root(config.run_dir), config.resume.step, interval=interval)
    for later in range(step + 1, config.max_steps + 1):
        batch_path(config.run_dir / "batches", later).unlink(missing_ok=True)
        shutil.rmtree(policy_dir(config.run_dir / "policies", later), ignore_errors=True)
    return step


def _cut_step_files(run_dir: Path, step: int) -> None:
    """Drop every record past `step` from the per-step files, before a child (or the live view) opens one."""
    for name in STEP_FILES:
        keep_steps_up_to(run_dir / name, step)


def weight_transport(config: RlConfig) -> tuple[str, str]:
    """The weight transport `trainer.weights.transport = "auto"` stands for, and why.

    shared needs every server to see the buffer trainer rank 0 keeps: on its GPU (CUDA IPC: the server must see
    that GPU) or, for a CPU trainer, in shared memory. Across separate GPUs the broadcast runs; vLLM only loads
    directories."""
    chosen = config.trainer.weights.transport
    if chosen != "auto":
        return chosen, "as configured"
    if config.inference.engine == "vllm":
        return "file", "vLLM loads policies from directories"
    deploy = config.deploy
    if not deploy.trainer_gpus:
        if deploy.inference_gpus:
            return "shared", "the trainer runs on CPU: its buffer is shared memory"
        return "shared", "trainer and inference share the same devices"
    per_server = len(deploy.inference_gpus) // deploy.inference_servers
    slices = [deploy.inference_gpus[k * per_server : (k + 1) * per_server] for k in range(deploy.inference_servers)]
    if all(deploy.trainer_gpus[0] in gpus for gpus in slices):
        return "shared", f"every inference server sees the trainer's GPU {deploy.trainer_gpus[0]}"
    if all(slices):
        return "broadcast", "trainer and inference run on separate GPUs"
    return "file", "inference runs on CPU, the trainer on a GPU"


def _configure(config: RlConfig, resume_step: int) -> RlConfig:
    """Wire the sections together: the trainer's world size and weight transport (and the address the servers
    may join its hand-off at), and the resume points."""
    transport, why = weight_transport(config)
    logger.info("weight transport: %s (%s)", transport, why)
    orchestrator = {
        "trainer_ranks": config.deploy.trainer_nproc,
        "resume_step": resume_step,
        "weight_transport": transport,
    }
    weights = config.trainer.weights.model_copy(update={"transport": transport})
    trainer = {"weights": weights}
    updates = {"orchestrator": config.orchestrator.model_copy(update=orchestrator)}
    if transport in ("broadcast", "shared") and not is_loopback(weights.host):
        hosts = sorted({*config.inference.broadcast_hosts, weights.host})
        updates["inference"] = config.inference.model_copy(update={"broadcast_hosts": hosts})
    if resume_step:
        trainer["resume"] = config.trainer.resume.model_copy(update={"enabled": True, "step": resume_step})
    updates["trainer"] = config.trainer.model_copy(update=trainer)
    return config.model_copy(update=updates)


def _with_servers(config: RlConfig, urls: list[str]) -> RlConfig:
    pool = config.orchestrator.inference.model_copy(update={"base_urls": urls})
    return config.model_copy(update={"orchestrator": config.orchestrator.model_copy(update={"inference": pool})})


def server_configs(config: RlConfig) -> dict[str, InferenceConfig]:
    """Each inference server's config. With several, server k keeps its run files (`inference.toml`, logs,
    `server.json`) in `<run>/servers/inference-<k>/`; every one may load policies from the output directory."""
    names = server_names(config.deploy)
    if len(names) == 1:
        return {names[0]: config.inference}
    weights_dir = config.inference.weights_dir or config.output_dir
    return {
        name: config.inference.model_copy(
            update={"output_dir": config.run_dir / "servers", "run_name": name, "weights_dir": weights_dir}
        )
        for name in names
    }


def _command(name: str, section: RunConfig, config: RlConfig) -> list[str]:
    """Write the process's resolved config next to the others and return the command that runs it."""
    file = config.run_dir / f"{name}.toml"
    atomic_write_text(file, to_toml(section))
    python = [sys.executable, "-m"]
    if name == "trainer" and config.deploy.trainer_nproc > 1:
        launcher = [*python, "torch.distributed.run", "--standalone", f"--nproc-per-node={config.deploy.trainer_nproc}"]
        return [*launcher, "-m", "tandem.trainer.rl", "@", str(file)]
    return [*python, "tandem", section.command, "@", str(file)]


def _wait_for_server(path: Path, server: LaunchedChild, timeout_s: float) -> str:
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
    def __init__(self, child: LaunchedChild):
        self.child = child
        super().__init__(child.name)


def check_rl(config: RlConfig) -> None:
    """What `tandem rl` checks before it starts anything, `--dry-run` included: every source resolves."""
    check_sources(config.orchestrator)


def run_rl(config: RlConfig) -> int:
    """The `tandem rl` runner."""
    check_rl(config)
    read_model_args(config.trainer)  # a bad model path is one line here, not a child's failure after start-up
    config, memory_plan = split_shared_gpu(config)  # one GPU for both: a split that cannot fit fails here
    token = run_admin_token(config)
    config = _without_admin_tokens(config)
    claim_run_dir(config.run_dir, resume=config.resume.enabled, overwrite=config.overwrite)
    prepare_run_dir(config, "rl")
    if memory_plan is not None:
        logger.info("%s", memory_plan)
    resume_step = _resume_step(config) if config.resume.enabled else 0
    _cut_step_files(config.run_dir, resume_step)
    config = _configure(config, resume_step)
    servers = server_configs(config)
    for stale in (*(s.run_dir / "server.json" for s in servers.values()), announce_path(config.run_dir)):
        stale.unlink(missing_ok=True)  # left by an earlier, killed run
    envs = child_envs(config.deploy)
    for name in (*servers, "orchestrator"):
        envs[name] = {**envs[name], ADMIN_TOKEN_ENV: token}
    children: list[LaunchedChild] = []
    progress = None
    try:
        for name, section in servers.items():
            children.append(_start(name, _command(name, section, config), config.run_dir, envs[name]))
        children.append(_start("trainer", _command("trainer", config.trainer, config), config.run_dir, envs["trainer"]))
        timeout = config.orchestrator.inference.startup_timeout_s
        urls = [
            _wait_for_server(section.run_dir / "server.json", child, timeout)
            for section, child in zip(servers.values(), children, strict=False)
        ]
        config = _with_servers(config, urls)
        command = _command("orchestrator", config.orchestrator, config)
        children.append(_start("orchestrator", command, config.run_dir, envs["orchestrator"]))
        progress = RlProgress(config, resume_step)
        while True:
            progress.refresh()
            failed = next((c for c in children if c.process.poll() not in (None, 0)), None)
            if failed is not None:
                raise ChildFailed(failed)
            if all(c.process.poll() == 0 for c in children if c.name not in servers):
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
