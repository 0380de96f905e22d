"""The trainer's end of the weight transport (`[trainer.weights]`): a `WeightPublisher` of the configured kind.

The kinds live in `tandem.transport.weights`; this module hands them the trainer's side as a `PolicySource`
(the full tensors, gathered one at a time on every rank; the Hugging Face export), so that package never
imports the trainer. `auto` is resolved by `tandem rl`; a trainer started alone takes `file`.

With LoRA (`[model.lora]`) a policy is the adapters alone: the in-memory kinds send only the adapter tensors
(runtime names, fp32, gathered from their shards), and `file` writes a PEFT adapter directory (`export_hf` ->
`export_adapter`); the servers hold the same frozen base and swap only their adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from tandem.config.trainer import TrainerConfig
from tandem.models.lora import is_adapter_name, lora_args
from tandem.trainer.model import ModelInfo, export_hf
from tandem.trainer.parallel import DTYPES, World, full_shapes, full_tensors
from tandem.transport.policies import mark_complete, policy_dir
from tandem.transport.weights.base import PolicySource, WeightPublisher
from tandem.transport.weights.broadcast import BroadcastPublisher
from tandem.transport.weights.file import FilePublisher
from tandem.transport.weights.shared import SharedPublisher

logger = logging.getLogger(__name__)


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(runtime name, whole fp32 adapter tensor) one at a time, gathered from every rank's shard; the frozen base
    is never gathered. Collective: every rank iterates to the end, in the same order."""
    for name, value in get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)).items():
        if is_adapter_name(name):
            yield name, (value.full_tensor() if isinstance(value, DTensor) else value).float()


def policy_source(config: TrainerConfig, world: World, model: torch.nn.Module, info: ModelInfo) -> PolicySource:
    dtype = DTYPES[config.model.dtype]
    if lora_args(model) is not None:  # only the adapters travel, in their own dtype (fp32)
        manifest = [(name, torch.float32, shape) for name, shape in full_shapes(model).items() if is_adapter_name(name)]

        def tensors():
            return (tensor for _, tensor in adapter_tensors(model))
    else:
        manifest = [(name, dtype, shape) for name, shape in full_shapes(model).items()]

        def tensors():
            return (tensor.to(dtype) for _, tensor in full_tensors(model))

    def export(version: int) -> None:
        path = policy_dir(config.run_dir / "policies", version)
        export_hf(model, info, path, world, config.model.dtype)
        if world.is_main:
            mark_complete(path)

    return PolicySource(
        run_dir=config.run_dir,
        final_version=config.max_steps,
        is_main=world.is_main,
        device=world.device,
        manifest=manifest,
        tensors=tensors,
        export=export,
    )


def make_publisher(config: TrainerConfig, world: World, model: torch.nn.Module, info: ModelInfo) -> WeightPublisher:
    weights = config.weights
    source = policy_source(config, world, model, info)
    transport = "file" if weights.transport == "auto" else weights.transport
    if world.is_main:
        logger.info("policies reach inference by %s", transport)
    if transport == "broadcast":
        backend = weights.backend if weights.backend != "auto" else "nccl" if world.device.type == "cuda" else "gloo"
        return BroadcastPublisher(source, weights.host, weights.port, backend, weights.timeout_s)
    if transport == "shared":
        return SharedPublisher(source, weights.host, weights.port, weights.timeout_s)
    return FilePublisher(source)
