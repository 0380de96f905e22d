"""`tandem merge-lora`: fold a PEFT LoRA adapter into its base model and write a full Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from tandem.config.base import Section
from tandem.config.common import LogConfig


class MergeLoraConfig(Section):
    base: str = ""
    """Base model: a Hugging Face directory or Hub id (default: the adapter's `base_model_name_or_path`)."""
    revision: str = ""
    """With a Hub id as base: the branch, tag or commit to fetch (default: main)."""
    adapter: Path = Path()
    """PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`), e.g. a run's `hf/final`."""
    out: Path = Path()
    """Directory to write the merged checkpoint to (config.json, safetensors, tokenizer files of the base)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the merged weights (auto: the base checkpoint's). Each weight is merged in fp32 and rounded once."""
    overwrite: bool = False
    """Replace `out` if it exists (otherwise an existing `out` is an error)."""
    log: LogConfig = LogConfig()
    """Logging."""
