"""Full training checkpoints: model, optimizer, scheduler, data position and RNG, resumable exactly.

Layout of `<run>/checkpoints/step-<N>/`: `model.safetensors` (fp32 master weights, unsharded),
`optimizer.safetensors` (AdamW moments, keyed by parameter name), `state.json` (step, scheduler,
param groups, RNG, anything else the loop needs). Tensors go through safetensors and the rest
through JSON, so loading never unpickles. Unsharded state means a checkpoint loads on any world
size. Every rank takes part in gathering; rank 0 writes into `step-<N>.tmp/` and renames it when
complete, so a directory named `step-<N>` is always whole.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tandem.config.errors import ConfigError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that is missing or unusable; the message names the directory."""


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(root: Path) -> dict[int, Path]:
    """Complete checkpoints under root, by step."""
    if not root.is_dir():
        return {}
    found = {}
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / "state.json").is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _rng_state() -> dict[str, list[int]]:
    state = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, list[int]]) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for name, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}::{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}::{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        name, key = flat.rsplit("::", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Write step-<step>/ atomically and keep only the newest `keep` checkpoints."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    final = root / f"step-{step:06d}"
    if _is_rank0():
        tmp = root / f"step-{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
        optim_tensors, optim_meta = _flatten_optimizer(optimizer_state)
        save_file(optim_tensors, str(tmp / "optimizer.safetensors"))
        state = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "optimizer": optim_meta,
            "rng": _rng_state(),
            "extra": extra,
        }
        (tmp / "state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old_step, path in list(list_checkpoints(root).items())[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
            logger.debug("removed old checkpoint %s (step %d)", path, old_step)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore everything save_checkpoint wrote; returns the state dict (step, extra, ...)."""
    for name in ("state.json", "model.safetensors", "optimizer.safetensors"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    state = json.loads((path / "state.json").read_text())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    set_model_state_dict(model, load_file(str(path / "model.safetensors")), options=options)
    optimizer_state = _unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    logger.info("resumed from %s (step %d)", path, state["step"])
    return state


def resolve_resume(root: Path, step: int | None) -> Path:
    """The checkpoint to resume from: a given step, or the latest."""
    found = list_checkpoints(root)
    if not found:
        raise CheckpointError(f"nothing to resume: no complete checkpoint under {root}")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise CheckpointError(f"no checkpoint for step {step} under {root}; found steps {sorted(found)}")
    return found[step]


def resume_step(config, model: torch.nn.Module, optimizer, scheduler) -> int:
    """Restore the checkpoint `config.resume` asks for (if any); the step training continues after."""
    if not config.resume.enabled:
        return 0
    root = config.run_dir / "checkpoints"
    return load_checkpoint(resolve_resume(root, config.resume.step), model, optimizer, scheduler)["step"]
