"""`tandem sft`: supervised fine-tuning."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from tandem.config.base import Section
from tandem.config.common import OptimConfig, RunConfig, SchedulerConfig


class SftDataConfig(Section):
    path: str = ""
    """Local JSONL file (`prompt`/`completion` or chat `messages` rows) or a Hugging Face dataset name."""
    fake: bool = False
    """Random token rows of seq_len instead of a dataset (benchmarking; no tokenizer needed)."""
    pack: bool = True
    """Pack samples into rows of seq_len tokens."""
    on_bad_row: Literal["skip", "fail"] = "skip"
    """What to do with a row that is malformed, empty or longer than seq_len."""


class SftConfig(RunConfig):
    command: ClassVar[str] = "sft"

    max_steps: int = Field(100, gt=0)
    """Optimizer steps to train for."""
    batch_size: int = Field(8, gt=0)
    """Rows of seq_len tokens per optimizer step, across all ranks."""
    micro_batch_size: int = Field(1, gt=0)
    """Rows per forward/backward pass on one rank (gradient accumulation fills the rest)."""
    seed: int = 0
    """Seed for initialisation, data order and dropout."""
    data: SftDataConfig = SftDataConfig()
    """Training data."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""
