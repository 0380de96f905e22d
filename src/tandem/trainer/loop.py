"""The training step loop that `tandem sft` and `tandem trainer` (RL) share, and the `speed.*` switches' set-up.

A command says where a step's micro-batches come from and what each one's loss is (a `Recipe`); the loop does
the rest, the same way for both: per step the monitor's clock, the scheduled garbage collection, the
micro-batch loop (gradient sync on the last micro-batch only), backward, clipping, the optimizer and scheduler
step, the divergence check, the step's metrics, checkpoints at `ckpt.interval` and Hugging Face exports at
`ckpt.hf_interval`. Step s (1..max_steps) is the s-th optimizer step; a resumed run continues at the step
after its checkpoint's.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from tandem.checkpoints import checkpoints_root
from tandem.config import ConfigError
from tandem.config.training import SpeedConfig, TrainingRunConfig
from tandem.model_kernels import kernel_options
from tandem.trainer import ckpt
from tandem.trainer.gc_schedule import scheduled_gc
from tandem.trainer.model import ModelInfo, build_training_model, export_hf
from tandem.trainer.monitor import Monitor, stop_if_diverged
from tandem.trainer.parallel import World, clip_grad_norm_
from tandem.trainer.schedule import build_optimizer

_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def sdpa_priority(names: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """SDPA kernels in the given order of preference (read when a block is traced, so compiled blocks too)."""
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA[name]) for name in names], set_priority=True)


@contextlib.contextmanager
def sync_check(mode: str, device: torch.device, active: bool) -> Iterator[None]:
    """Warn or fail on host-device syncs inside the block (`speed.sync_debug`; GPU only, where syncs exist)."""
    if mode == "off" or device.type != "cuda" or not active:
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host-device sync: on a GPU through pinned memory, since a copy from
    pageable memory waits for the GPU to drain its queue first, and one from pinned memory is queued behind it."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def model_runtime(speed: SpeedConfig, device: torch.device, fullgraph: bool = False) -> dict:
    """The model runtime options the speed switches choose (Triton kernels, benchmark routing). The hybrid layers'
    chunked kernels run outside torch.compile (a graph break), so blocks compiled with `fullgraph` take their torch
    path under `auto`, and refuse an explicit `triton`."""
    recurrent = {"delta_scan": speed.delta_scan_kernel, "ssd": speed.ssd_kernel}
    if fullgraph:
        explicit = [f"speed.{name}_kernel" for name, kernel in recurrent.items() if kernel == "triton"]
        if explicit:
            raise ConfigError(
                f"{' and '.join(explicit)} = triton runs outside torch.compile, a graph break: set fullgraph = false "
                "or the kernel to torch"
            )
        recurrent = {name: "torch" for name in recurrent}
    kernels = kernel_options(
        device, rope=speed.rope_kernel, swiglu=speed.swiglu_kernel, index=speed.index_kernel, **recurrent
    )
    return {**kernels, "moe_balanced_routing": speed.moe_balanced_routing}


@dataclass
class Training:
    """What the loop trains: the model (FSDP2 or a plain module), its optimizer and learning-rate schedule."""

    model: torch.nn.Module
    info: ModelInfo
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_training(config: TrainingRunConfig, world: World) -> Training:
    """The model and optimizer as the speed switches ask: FSDP2 or autocast on one process, kernels, fused AdamW."""
    speed = config.speed
    model, info = build_training_model(
        config,
        world,
        shard=speed.fsdp_single_process,
        **model_runtime(speed, world.device, config.compile and config.fullgraph),
    )
    optimizer, scheduler = build_optimizer(model, config, fused=speed.fused_optimizer)
    return Training(model, info, optimizer, scheduler)


@dataclass
class StepBatch:
    """One step's work on this rank."""

    step: int
    micros: list[Any]
    """This rank's micro-batches, each handed to `Recipe.loss` (every rank has the same number)."""
    real_tokens: int
    """Non-padding tokens of the whole step, over every rank (for tokens/s and MFU)."""
    values: dict[str, float] = field(default_factory=dict)
    """Numbers of the whole step to record as they are (already global)."""


class Recipe(abc.ABC):
    """What a command adds to the step loop: its batches, its loss, and what it does around a step."""

    ratios: dict[str, tuple[str, str]] = {}  # noqa: RUF012 (read only)
    """Metrics recorded as one summed metric over another (`Monitor.end_step`)."""

    def wait(self, step: int) -> dict[str, float]:
        """Before the step's clock starts (RL: wait for the orchestrator's batch); returns values to record."""
        return {}

    @abc.abstractmethod
    def batch(self, step: int) -> StepBatch:
        """The step's micro-batches for this rank (inside the step's clock and its sync check)."""

    @abc.abstractmethod
    def loss(
        self, model: torch.nn.Module, micro: Any, batch: StepBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of the step's loss (summed over every micro-batch of every rank, the loss of
        the step) and its metrics as partial sums over the same; both 0-d tensors, nothing synced to the host."""

    def after_update(self, step: int) -> dict[str, float]:
        """After the optimizer step of a finite step, before it is recorded (RL: publish the policy)."""
        return {}


def run_steps(
    config: TrainingRunConfig, world: World, training: Training, recipe: Recipe, start_step: int, monitor: Monitor
) -> None:
    """Steps start_step+1 .. max_steps, then the final training checkpoint when `speed.save_final`."""
    speed = config.speed
    model, optimizer, scheduler = training.model, training.optimizer, training.scheduler
    ckpt_root = checkpoints_root(config.run_dir)
    with scheduled_gc(config.gc_interval) as after_step:
        for step in range(start_step + 1, config.max_steps + 1):
            values = recipe.wait(step)
            monitor.start_step()
            after_step(step - 1)  # timed with the step, as torchtitan times its collections
            # the process's first step is exempt: it compiles and autotunes
            with sync_check(speed.sync_debug, world.device, active=step > start_step + 1):
                batch = recipe.batch(step)
                sums = _accumulate_gradients(model, recipe, batch, world, speed)
                grad_norm = clip_grad_norm_(model, config.optim.max_grad_norm, optimizer)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            stop_if_diverged(step, world, loss=sums["loss"], grad_norm=grad_norm)
            values = {**values, **recipe.after_update(step)}
            monitor.end_step(
                step,
                sums=sums,
                values={"grad_norm": grad_norm, "lr": lr, **batch.values, **values},
                real_tokens=batch.real_tokens,
                ratios=recipe.ratios,
            )
            if step < config.max_steps:  # the last step's are the final ones
                if config.ckpt.interval and step % config.ckpt.interval == 0:
                    ckpt.save_checkpoint(ckpt_root, step, model, optimizer, scheduler, config.ckpt.keep)
                if config.ckpt.hf_interval and step % config.ckpt.hf_interval == 0:
                    path = config.run_dir / "hf" / f"step-{step:06d}"
                    export_hf(model, training.info, path, world, config.model.dtype)
    if speed.save_final:
        ckpt.save_checkpoint(ckpt_root, config.max_steps, model, optimizer, scheduler, config.ckpt.keep)


def _accumulate_gradients(
    model: torch.nn.Module, recipe: Recipe, batch: StepBatch, world: World, speed: SpeedConfig
) -> dict[str, torch.Tensor]:
    """Forward and backward every micro-batch; returns the summed metrics, `loss` among them."""
    sums: dict[str, torch.Tensor] = {}
    last = len(batch.micros) - 1
    for index, micro in enumerate(batch.micros):
        if isinstance(model, FSDPModule):  # not a plain module (speed.fsdp_single_process off)
            model.set_requires_gradient_sync(index == last)
        with sdpa_priority(speed.sdpa_backends):
            loss, metrics = recipe.loss(model, micro, batch)
        # FSDP averages gradients over ranks; scaling by world size makes them the gradient of the step's loss,
        # the sum of every micro-batch's share on every rank, however the batch is split.
        (loss * world.world_size).backward()
        for name, value in {"loss": loss.detach(), **metrics}.items():
            sums[name] = sums[name] + value if name in sums else value
    return sums
