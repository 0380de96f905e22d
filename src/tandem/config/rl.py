"""`tandem rl`: inference, orchestrator and trainer started together on one machine."""

from __future__ import annotations

from typing import ClassVar

from tandem.config.common import RunConfig
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.trainer import TrainerConfig


class RlConfig(RunConfig):
    command: ClassVar[str] = "rl"

    trainer: TrainerConfig = TrainerConfig()
    """The trainer process."""
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator process."""
    inference: InferenceConfig = InferenceConfig()
    """The inference server."""
