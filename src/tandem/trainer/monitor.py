"""What a training run shows and records each step: a rich progress bar, log lines, metrics.jsonl, W&B."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from tandem.config import ConfigError
from tandem.run import RunError, step_progress
from tandem.trainer.metrics import MetricsWriter, StepTimer, device_peak_flops, peak_memory_gib, peak_reserved_gib
from tandem.trainer.parallel import World

logger = logging.getLogger(__name__)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def stop_if_diverged(step: int, world: World, **values: torch.Tensor) -> None:
    """Stop the run at a step whose loss or gradient norm is NaN or infinite, before that step's weights are
    checkpointed, exported or published: training on would only spread the NaN into every later step and
    into what inference serves. `values` may be one rank's partial sums: they are added over ranks in one
    all-reduce (a non-finite value on any rank stays non-finite), so every rank stops at the same step."""
    stacked = torch.stack([_full(value).detach().float().to(world.device).reshape(()) for value in values.values()])
    if dist.is_initialized() and world.world_size > 1:
        dist.all_reduce(stacked)
    bad = [
        f"{name} is {value}" for name, value in zip(values, stacked.tolist(), strict=True) if not math.isfinite(value)
    ]
    if bad:
        raise RunError(
            f"step {step}: {' and '.join(bad)}, so training diverged; stopped before saving this step's weights "
            "(a lower optim.lr or a warm-up, scheduler.warmup_steps, may keep it finite)"
        )


class Monitor:
    """Rank 0 shows and writes; every rank joins the one all-reduce of the step's loss."""

    def __init__(self, config, world: World, info, start_step: int):
        self.config, self.world, self.info = config, world, info
        self.peak_flops = device_peak_flops(world.device)
        self.timer = StepTimer(world.device)
        self.writer = MetricsWriter(config.run_dir / "metrics.jsonl", start_step) if world.is_main else None
        self.progress = None
        self.wandb = None
        if world.is_main:
            self.progress, self.task = step_progress(config.command, config.max_steps, start_step)
            if config.wandb.enabled:
                self.wandb = _start_wandb(config)

    def start_step(self) -> None:
        self.timer.lap()
        if self.world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.world.device)

    def end_step(
        self,
        step: int,
        sums: dict[str, torch.Tensor],
        values: dict[str, float | torch.Tensor],
        real_tokens: int,
        ratios: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        """Record a step: `sums` are per-rank partial sums (added over ranks in one all-reduce),
        `values` are already global (grad norm, LR); `real_tokens` counts non-padding tokens;
        `ratios` names metrics computed as one global sum over another (None when the divisor is 0)."""
        names = list(sums)
        stacked = torch.stack([sums[name].float() for name in names])
        if dist.is_initialized() and self.world.world_size > 1:
            dist.all_reduce(stacked)
        step_time = self.timer.lap()
        if not self.world.is_main:
            return
        tokens_per_s = real_tokens / step_time
        record: dict[str, Any] = {"step": step, **dict(zip(names, stacked.tolist(), strict=True))}
        for name, (numerator, denominator) in (ratios or {}).items():
            top, bottom = record.pop(numerator), record.pop(denominator)
            record[name] = top / bottom if bottom else None
        record.update({k: float(_full(v)) if isinstance(v, torch.Tensor) else v for k, v in values.items()})
        record.update(
            tokens=real_tokens,
            tokens_per_s=tokens_per_s,
            step_time_s=step_time,
            mfu=self.info.flops_per_token * tokens_per_s / (self.peak_flops * self.world.world_size)
            if self.peak_flops
            else None,
            peak_memory_gib=peak_memory_gib(self.world.device),
            peak_reserved_gib=peak_reserved_gib(self.world.device),
            time=time.time(),
        )
        self.writer.write(record)
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        self.progress.update(self.task, completed=step, status=f"loss {record['loss']:.4f}  {tokens_per_s:,.0f} tok/s")
        if step % self.config.log_interval == 0 or step == self.config.max_steps:
            shown = "  ".join(
                f"{k} {v:.4g}"
                for k, v in record.items()
                if k in (*sums, *values, *(ratios or {})) and isinstance(v, float)
            )
            mfu = f"  mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
            logger.info(
                "step %d/%d  %s  %s real tok/s  %.3fs  mem %.2f GiB%s",
                step,
                self.config.max_steps,
                shown,
                f"{tokens_per_s:,.0f}",
                step_time,
                record["peak_memory_gib"],
                mfu,
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(config):
    try:
        import wandb
    except ImportError:
        raise ConfigError("wandb.enabled needs the wandb extra: pip install -e '.[wandb]'") from None
    return wandb.init(project=config.wandb.project, name=config.run_name, config=config.model_dump(mode="json"))
