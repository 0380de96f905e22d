"""`tandem merge-lora`: base model + PEFT LoRA adapter -> one full Hugging Face checkpoint (docs/lora.md).

The base is loaded in the output dtype, the adapter put on it (`models.lora.load_peft_adapter`) and folded into
the weights (`merge_lora`: `W += alpha / r * B @ A`, summed in fp32, rounded once), then written by
`models.save_model`, which transformers and vLLM load unchanged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.config.merge import MergeLoraConfig
from tandem.hub import fetch, is_hub_id
from tandem.models import load_model, model_args, save_model
from tandem.models.lora import ADAPTER_CONFIG, LoraError, load_peft_adapter, merge_lora
from tandem.run import setup_logging

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _base_dir(config: MergeLoraConfig) -> Path:
    base = config.base
    if not base:
        try:
            base = json.loads((config.adapter / ADAPTER_CONFIG).read_bytes()).get("base_model_name_or_path") or ""
        except (OSError, ValueError, AttributeError):
            base = ""
        if not base:
            raise ConfigError(f"set --base: adapter {config.adapter} does not name its base model")
        logger.info("base model %s (the adapter's base_model_name_or_path)", base)
    path = Path(base).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(base):
        return fetch(base, config.revision)
    raise ConfigError(f"base {base}: no such directory, and not a Hugging Face Hub id")


def run(config: MergeLoraConfig) -> int:
    setup_logging(config.log.level)
    if config.adapter == Path() or not config.adapter.is_dir():
        raise ConfigError(f"--adapter {config.adapter}: give the PEFT adapter directory (e.g. <run>/hf/final)")
    if config.out == Path():
        raise ConfigError("set --out, the directory to write the merged checkpoint to")
    if config.out.exists() and not config.overwrite:
        raise ConfigError(f"--out {config.out} exists; pass --overwrite to replace it")
    base = _base_dir(config)
    try:
        args = model_args(base)
    except (ValueError, OSError) as error:
        raise ConfigError(f"base {base}: {error}") from None
    dtype = args.dtype if config.dtype == "auto" else _DTYPES[config.dtype]
    model = load_model(base, dtype=dtype)
    try:
        lora = load_peft_adapter(model, config.adapter)
    except LoraError as error:
        raise ConfigError(f"adapter {config.adapter}: {error}") from None
    merge_lora(model)
    save_model(model, config.out, dtype=dtype, tokenizer_dir=base)
    logger.info(
        "merged adapter %s (%s) into %s: %s (%s)",
        config.adapter,
        lora,
        base,
        config.out,
        str(dtype).removeprefix("torch."),
    )
    return 0
