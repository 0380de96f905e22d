"""Process group set-up and FSDP2 wrapping, the same on one CPU process as on many GPUs."""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tandem.trainer import expert_parallel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 600.0) -> World:
    """Join the torchrun group (or make a group of one) on NCCL for GPUs, gloo for CPU."""
    use_cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        # Adam updates drive tiny weights into denormal floats, which x86 CPUs compute far more slowly
        # (benchmarks/RESULTS.md). Flushing them to zero costs nothing.
        torch.set_flush_denormal(True)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    logger.debug("rank %d/%d on %s", rank, world_size, device)
    return World(rank, world_size, local_rank, device)


def shard_model(model: torch.nn.Module, param_dtype: str, reduce_dtype: str = "float32") -> torch.nn.Module:
    """fully_shard every decoder block, then the root: fp32 master weights, compute in `param_dtype`.

    Expert-parallel experts (`expert_parallel.py`) are already split over ranks; FSDP leaves them alone."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    ignored = {param for param, _ in expert_parallel.expert_params(model).values()} or None
    for block in model.layers:
        fully_shard(block, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mp_policy=policy, ignored_params=ignored)
    return model


def clip_grad_norm_(
    model: torch.nn.Module, max_norm: float, optimizer: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    """Clip the global gradient norm after the last backward of a step; returns the norm before clipping.

    With expert parallelism this also finishes the expert gradients (`expert_parallel.reduce_and_clip`).
    When `optimizer` is torch's fused Adam/AdamW over unsharded parameters, the clip is no separate pass over
    the gradients: the optimizer's kernel divides each gradient by the clip factor as it reads it (its
    `grad_scale`, the hook `torch.amp.GradScaler` uses, so the two do not mix), equal to clipping first up to
    fp32 rounding. The factor holds for the next `optimizer.step()`; every call sets or clears it."""
    if optimizer is not None:
        optimizer.__dict__.pop("grad_scale", None)
    if expert_parallel.expert_params(model):
        return expert_parallel.reduce_and_clip(model, max_norm)
    if optimizer is not None and _scales_gradients(optimizer):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        # clip_grad_norm_ multiplies by max_norm / (norm + 1e-6) when that is below 1; divide by its inverse
        optimizer.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
        return norm
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _scales_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` divides the gradients by `optimizer.grad_scale` (fused Adam/AdamW, plain tensors)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fused = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and optimizer.defaults.get("fused")
    return bool(fused) and not any(isinstance(p, DTensor) for p in params)


def full_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The whole shape of every tensor `full_tensors` yields, in the same order, without gathering anything."""
    experts = expert_parallel.expert_params(model)
    shapes = {}
    for name, value in get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)).items():
        groups = experts[name][1] if name in experts else None
        shapes[name] = (value.shape[0] * groups.size, *value.shape[1:]) if groups else tuple(value.shape)
    return shapes


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, whole tensor on the device) one at a time, gathered from every rank's shard.

    Collective: every rank iterates to the end, in the same order. Only one whole tensor exists at a time, so
    the weights can be written or sent without a full copy anywhere."""
    experts = expert_parallel.expert_params(model)
    for name, value in get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)).items():
        if isinstance(value, DTensor):
            yield name, value.full_tensor()
        elif name in experts:
            yield name, expert_parallel.gather_experts(value, experts[name][1])
        else:
            yield name, value


def shutdown_distributed() -> None:
    """Destroy the process groups once nothing holds them any more.

    FSDP2's state sits in reference cycles that keep its process groups alive past the caller's last reference;
    left to the interpreter's exit, gloo's worker threads are torn down after Python is, and the process can die
    in `terminate called without an active exception` (seen once in CI, a 2-rank gloo run that had finished).
    Callers drop their model, optimizer and the like first; the collection here frees them while Python is alive.
    """
    gc.collect()
    dist.destroy_process_group()
