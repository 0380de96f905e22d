"""`tandem sft`: supervised fine-tuning."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from tandem.config.base import Section
from tandem.config.training import TrainingRunConfig


class SftDataConfig(Section):
    path: str = ""
    """Local JSONL file (`prompt`/`completion` or chat `messages` rows), a local dataset directory (`save_to_disk` output, or parquet/JSONL/CSV files), or a Hugging Face Hub dataset id (`org/name`, fetched into the Hugging Face cache once); the last two need `pip install 'tandem[datasets]'`."""
    split: str = Field("train", min_length=1)
    """With a dataset directory or Hub dataset: the split to read."""
    subset: str = ""
    """With a dataset of several subsets (configurations; `datasets.load_dataset`'s `name`): the one to read."""
    revision: str = ""
    """With a Hub dataset id: the branch, tag or commit to read (default: main)."""
    fake: bool = False
    """Random token rows of seq_len instead of a dataset (benchmarking; no tokenizer needed)."""
    pack: bool = True
    """Pack samples into rows of seq_len tokens (off: one sample per row, padded)."""
    on_bad_row: Literal["skip", "fail"] = "skip"
    """What to do with a row that is malformed, empty or longer than seq_len."""


class DeployConfig(Section):
    nproc: int = Field(1, gt=0)
    """Trainer processes on this machine; above 1, `tandem sft` launches torchrun itself."""


class SftConfig(TrainingRunConfig):
    command: ClassVar[str] = "sft"

    batch_size: int = Field(8, gt=0)
    """Rows of seq_len tokens per optimizer step, across all ranks."""
    micro_batch_size: int = Field(1, gt=0)
    """Rows per forward/backward pass on one rank (gradient accumulation fills the rest)."""
    data: SftDataConfig = SftDataConfig()
    """Training data."""
    deploy: DeployConfig = DeployConfig()
    """Processes to launch."""
    overwrite: bool = Field(False, exclude=True)
    """Start over in a run directory that holds an earlier run, deleting it first (never saved with the config)."""
