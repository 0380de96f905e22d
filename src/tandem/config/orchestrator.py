"""`tandem orchestrator`: rollouts, rewards, advantages and batches."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from tandem.config.common import RunConfig


class OrchestratorConfig(RunConfig):
    command: ClassVar[str] = "orchestrator"

    batch_size: int = Field(64, gt=0)
    """Rollouts per trainer step."""
    group_size: int = Field(8, gt=0)
    """Rollouts per task (one GRPO group)."""
    async_level: int = Field(1, ge=0)
    """How many policy versions inference may run ahead of the trainer."""
    max_off_policy_steps: int = Field(8, ge=0)
    """Drop a sample whose producing policy is more than this many steps older than the step it would train."""
