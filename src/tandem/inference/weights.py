"""Loading a checkpoint directory into the running model: read and check everything first, then copy in place.

Reading (the slow part) happens off the engine thread while generation continues, into CPU memory (one copy
of the weights); only the in-place copy pauses generation. Copying in place keeps every parameter's storage,
so CUDA graphs captured against it stay valid. A checkpoint is only accepted from inside the configured
weights directory, and only if it describes the same architecture and shapes; otherwise nothing is touched.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tandem.models import RUNTIME_OPTIONS, CausalLM, CheckpointError, iter_runtime_tensors, model_args
from tandem.models import ConfigError as ModelConfigError


class WeightsError(ValueError):
    """A weights path or checkpoint the server refuses; the message says why."""


class ForbiddenWeightsPath(WeightsError):
    """A path outside the directory the server may load weights from."""


def resolve_weights_path(path: str, allowed_root: Path) -> Path:
    """`path` as a real directory inside `allowed_root` (symlinks resolved), or WeightsError."""
    root = allowed_root.resolve()
    target = Path(path).expanduser()
    target = (target if target.is_absolute() else root / target).resolve()
    if not target.is_relative_to(root):
        raise ForbiddenWeightsPath(f"{path} is outside the weights directory {root}")
    if not target.is_dir():
        raise WeightsError(f"{target} is not a checkpoint directory")
    return target


def read_weights(path: Path, model: CausalLM) -> dict[str, torch.Tensor]:
    """Every runtime tensor of the checkpoint at `path`, on CPU, checked against `model`'s names and shapes."""
    current = model.args
    try:
        runtime = {name: getattr(current, name) for name in ("dtype", *RUNTIME_OPTIONS)}
        args = model_args(path).replace(**runtime)
        differ = [
            f.name for f in dataclasses.fields(args) if f.compare and getattr(args, f.name) != getattr(current, f.name)
        ]
        if differ:
            raise WeightsError(f"{path} holds a different model than the one being served (differs in {differ})")
        params = dict(model.named_parameters())
        tensors = {}
        for name, tensor in iter_runtime_tensors(path, args):
            if tensor.shape != params[name].shape:
                raise WeightsError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            tensors[name] = tensor
    except (CheckpointError, ModelConfigError, OSError) as error:
        raise WeightsError(f"cannot load {path}: {error}") from error
    return tensors


@torch.no_grad()
def copy_weights(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `read_weights`' tensors into the model's parameters (converting dtype, onto their device)."""
    for name, param in model.named_parameters():
        param.copy_(tensors[name], non_blocking=True)
    if model.lm_head_weight.is_cuda:
        torch.cuda.synchronize(model.lm_head_weight.device)
