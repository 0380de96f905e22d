"""`tandem trainer`: the RL trainer process (a torchrun group)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from tandem.config.common import OptimConfig, RunConfig, SchedulerConfig


class TrainerConfig(RunConfig):
    command: ClassVar[str] = "trainer"

    max_steps: int = Field(100, gt=0)
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed for initialisation."""
    optim: OptimConfig = OptimConfig(lr=1e-6)
    """Optimizer."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""
