"""The optimizer and its learning-rate schedule: linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math

import torch

from tandem.config.common import SchedulerConfig
from tandem.config.training import TrainingRunConfig
from tandem.models.lora import lora_args, lora_parameters
from tandem.trainer.expert_parallel import param_groups


def lr_factor(step: int, total_steps: int, config: SchedulerConfig) -> float:
    """Multiplier of the peak LR used for optimizer step `step` (0-based)."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.type == "constant":
        return 1.0
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    shape = 1.0 - progress if config.type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))


def build_optimizer(
    model: torch.nn.Module, config: TrainingRunConfig, fused: bool = False
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the (fp32 master) parameters, or only the LoRA adapters when the model has them, and its
    schedule over `config.max_steps`."""
    optimizer = torch.optim.AdamW(
        lora_parameters(model) if lora_args(model) is not None else param_groups(model),
        lr=config.optim.lr,
        betas=config.optim.betas,
        eps=config.optim.eps,
        weight_decay=config.optim.weight_decay,
        fused=fused,
    )
    return optimizer, build_scheduler(optimizer, config.max_steps, config.scheduler)
