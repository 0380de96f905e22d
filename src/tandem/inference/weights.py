"""Loading a checkpoint directory into the running model: read and check everything first, then copy in place.

Reading (the slow part) happens off the engine thread while generation continues, into CPU memory (one copy
of the weights); only the in-place copy pauses generation. Copying in place keeps every parameter's storage,
so CUDA graphs captured against it stay valid. A checkpoint is only accepted from inside the configured
weights directory, with every file it opens inside the checkpoint directory (symlinks resolved, index entries
included), only if it describes the same architecture and shapes, and only if every weight is finite (a NaN
would poison every KV cache entry computed from it until the next update); otherwise nothing is touched.

The tensor check is `check_same_model`, the one every way of loading weights shares. The built-in engine
compares the tensors it read with its parameters (`read_weights`); a server without tandem's model (vLLM)
compares the checkpoint's safetensors headers with those of the directory it serves (`check_checkpoint`).
A refusal is a `WeightsError`: a 400 naming the file, or a 403 for a path outside where weights may come from.

A model served with LoRA adapters (`tandem.models.lora`, docs/lora.md) takes only adapters: its weights are the
adapter tensors (`weight_targets`), a checkpoint is a PEFT adapter directory (`read_adapter_weights`) and the
frozen base is never replaced (folded adapters, `inference.lora_fold`, are folded into it again from a kept copy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch

from tandem.inference.limits import RequestRefused
from tandem.models import (
    CausalLM,
    ModelArgs,
    ModelWeightsError,
    OutsideDirectoryError,
    all_finite,
    iter_runtime_tensors,
    model_args,
    open_safetensors,
    resolve_inside,
)
from tandem.models.lora import (
    ADAPTER_CONFIG,
    LoraArgs,
    LoraError,
    clean_name,
    fold_adapters,
    from_peft_state_dict,
    is_adapter_name,
    lora_args,
    lora_folded,
    read_adapter,
)
from tandem.transport.weights.control import check_same_model

Shapes = Mapping[str, tuple[int, ...]]


class WeightsError(RequestRefused):
    """A weights path or checkpoint the server refuses; the message names the file and says why."""

    param = "path"


class ForbiddenWeightsPath(WeightsError):
    """A path outside the directory the server may load weights from."""

    status = 403


def resolve_weights_path(path: str, allowed_root: Path) -> Path:
    """`path` as a real directory inside `allowed_root` (symlinks resolved), or WeightsError."""
    target = Path(path).expanduser()
    try:
        target = resolve_inside(target if target.is_absolute() else allowed_root / target, allowed_root)
    except OutsideDirectoryError:
        raise ForbiddenWeightsPath(f"{path} is outside the weights directory {allowed_root.resolve()}") from None
    if not target.is_dir():
        raise WeightsError(f"{target} is not a checkpoint directory")
    return target


def checkpoint_args(path: Path, current: ModelArgs) -> ModelArgs:
    """The checkpoint's ModelArgs (the served dtype kept): WeightsError naming its config.json unless it
    describes the served model `current` (ForbiddenWeightsPath for a config.json that links out of `path`)."""
    config = path / "config.json"
    try:
        config = resolve_inside(config, path)
        args = model_args(config).replace(dtype=current.dtype)
    except OutsideDirectoryError as error:
        raise ForbiddenWeightsPath(str(error)) from None
    except (ValueError, OSError, TypeError, KeyError) as error:  # a value of the wrong type fails as it is used
        raise WeightsError(f"{config} is not a usable model config: {error}") from None
    differ = [
        f.name for f in dataclasses.fields(args) if f.compare and getattr(args, f.name) != getattr(current, f.name)
    ]
    if differ:
        raise WeightsError(f"{path} holds a different model than the one being served (differs in {differ})")
    return args


def _check_finite(path: Path, name: str, tensor: torch.Tensor) -> None:
    """WeightsError if `tensor` holds a NaN or an infinity (`models.all_finite`)."""
    if not all_finite(tensor):
        raise WeightsError(f"{path}: {name} holds NaN or infinite values; refusing to serve them")


def _check_same_model(served: Shapes, offered: Shapes, path: Path) -> None:
    problem = check_same_model(served, offered, str(path))
    if problem is not None:
        raise WeightsError(problem)


def weight_targets(model: CausalLM) -> dict[str, torch.Tensor]:
    """The parameters new weights replace, by runtime name: every one, or with LoRA adapters only the adapters
    (the base stays frozen as it was loaded)."""
    params = dict(model.named_parameters())
    if lora_args(model) is None:
        return params
    return {clean_name(name): param for name, param in params.items() if is_adapter_name(name)}


def read_served_adapter(path: Path, served: LoraArgs) -> dict[str, torch.Tensor]:
    """The PEFT adapter directory `path`'s tensors (PEFT keys, on CPU), read only from inside `path` by the one
    adapter loader (`read_adapter`: a well-formed config, float tensors of its rank, finite values) and checked to
    have the served adapters' rank, alpha and targets; WeightsError (or ForbiddenWeightsPath)."""
    for name in (ADAPTER_CONFIG, "adapter_model.safetensors"):
        try:
            resolve_inside(path / name, path)
        except OutsideDirectoryError as error:
            raise ForbiddenWeightsPath(str(error)) from None
    try:
        args, peft = read_adapter(path)
    except LoraError as error:
        raise WeightsError(f"cannot load the adapter {path}: {error}") from None
    if args.layout != served.layout:
        raise WeightsError(f"{path}: the adapter has {args}; the served adapters {served}")
    return peft


def read_adapter_weights(path: Path, model: CausalLM) -> dict[str, torch.Tensor]:
    """The adapter tensors (runtime names, on CPU) of the PEFT adapter directory `path` for a model served with
    adapters: the same rank, alpha and targets, every tensor finite and of the served shape."""
    served = lora_args(model)
    assert served is not None
    peft = read_served_adapter(path, served)
    try:
        tensors = from_peft_state_dict(model, peft)
    except LoraError as error:
        raise WeightsError(f"cannot load the adapter {path}: {error}") from None
    targets = weight_targets(model)
    _check_same_model(
        {name: tuple(t.shape) for name, t in targets.items()}, {n: tuple(t.shape) for n, t in tensors.items()}, path
    )
    return tensors


def read_weights(path: Path, model: CausalLM) -> dict[str, torch.Tensor]:
    """Every runtime tensor of the checkpoint at `path`, on CPU, checked against `model`'s names and shapes and
    for finite values; every file opened lies inside `path`. A model served with LoRA adapters takes a PEFT
    adapter directory instead (`read_adapter_weights`)."""
    has_adapter = (path / ADAPTER_CONFIG).is_file()
    if lora_args(model) is not None:
        if not has_adapter:
            raise WeightsError(
                f"{path} is not a PEFT adapter directory ({ADAPTER_CONFIG}): this server serves LoRA adapters, and "
                "/update_weights replaces only them"
            )
        return read_adapter_weights(path, model)
    if has_adapter and not (path / "config.json").is_file():
        raise WeightsError(
            f"{path} is a PEFT adapter directory, but this server serves no LoRA adapters (start it with "
            "inference.lora_adapter or model.lora)"
        )
    args = checkpoint_args(path, model.args)
    tensors = {}
    try:
        for name, tensor in iter_runtime_tensors(path, args, confined=True):
            _check_finite(path, name, tensor)
            tensors[name] = tensor
    except OutsideDirectoryError as error:
        raise ForbiddenWeightsPath(f"cannot load {path}: {error}") from None
    except (ModelWeightsError, OSError) as error:
        raise WeightsError(f"cannot load {path}: {error}") from None
    served = {name: tuple(param.shape) for name, param in model.named_parameters()}
    _check_same_model(served, {name: tuple(tensor.shape) for name, tensor in tensors.items()}, path)
    return tensors


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over a checkpoint directory's safetensors, from their headers alone;
    OutsideDirectoryError for a file that links out of the directory, ModelWeightsError naming a file that is not
    readable safetensors."""
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with open_safetensors(resolve_inside(file, path)) as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_checkpoint(path: Path, served_args: ModelArgs, served_shapes: Shapes) -> None:
    """WeightsError unless the checkpoint directory `path` holds the served model (`served_args`, and the tensor
    names and shapes of the served directory's `checkpoint_shapes`), from its config.json and safetensors headers
    alone: the check of a server that loads the tensors elsewhere (vLLM's workers)."""
    checkpoint_args(path, served_args)
    try:
        shapes = checkpoint_shapes(path)
    except OutsideDirectoryError as error:
        raise ForbiddenWeightsPath(f"cannot load {path}: {error}") from None
    except (ModelWeightsError, OSError) as error:
        raise WeightsError(f"cannot load {path}: {error}") from None
    _check_same_model(served_shapes, shapes, path)


@torch.no_grad()
def copy_weights(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `read_weights`' tensors into the model's parameters (`weight_targets`: with LoRA, the adapters only),
    converting dtype, onto their device."""
    for name, param in weight_targets(model).items():
        param.copy_(tensors[name], non_blocking=True)
    if lora_folded(model):  # the served weights are base + adapters: fold the new adapters in
        fold_adapters(model)
    if model.lm_head_weight.is_cuda:
        torch.cuda.synchronize(model.lm_head_weight.device)
