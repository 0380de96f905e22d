"""`tandem merge-lora`: base model + PEFT LoRA adapter -> one full Hugging Face checkpoint (docs/lora.md).

The base is loaded in the output dtype, the adapter put on it (`models.lora.load_peft_adapter`, through the one
adapter loader and its checks) and folded into the weights (`merge_lora`: `W += alpha / r * B @ A`, summed in
fp32, rounded once), then written by `models.save_model`, which transformers and vLLM load unchanged. Nothing is
written unless every merged weight is finite (a large adapter overflows fp16 or bf16), and never where it could
replace an input: `--out` may not be, lie inside or contain `--base` or `--adapter` (or a file one links to).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.config.merge import MergeLoraConfig
from tandem.hub import fetch, is_hub_id
from tandem.models import all_finite, load_model, model_args, save_model
from tandem.models.lora import LoraError, load_peft_adapter, merge_lora, read_adapter_config
from tandem.run import setup_logging

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _base_dir(config: MergeLoraConfig) -> Path:
    base = config.base
    if not base:
        try:
            base = read_adapter_config(config.adapter).base_model
        except LoraError as error:
            raise ConfigError(f"adapter {config.adapter}: {error}") from None
        if not base:
            raise ConfigError(f"set --base: adapter {config.adapter} does not name its base model")
        logger.info("base model %s (the adapter's base_model_name_or_path)", base)
    path = Path(base).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(base):
        return fetch(base, config.revision)
    raise ConfigError(f"base {base}: no such directory, and not a Hugging Face Hub id")


def _real_paths(directory: Path) -> list[Path]:
    """What reading `directory` touches: the directory itself and, for each entry that is a symlink (as in the
    Hugging Face cache's snapshots), its target, all with symlinks resolved."""
    root = directory.resolve()
    return [root, *(entry.resolve() for entry in root.iterdir() if entry.is_symlink())]


def check_out(out: Path, inputs: dict[str, Path]) -> None:
    """ConfigError if writing the directory `out` could destroy or change an input (`flag` -> directory): `out`
    is it, lies inside it, or contains it or a file it links to, compared with every symlink resolved."""
    target = out.expanduser().resolve()
    for flag, directory in inputs.items():
        for real in _real_paths(directory):
            if target == real:
                how = "is"
            elif target.is_relative_to(real):
                how = "lies inside"
            elif real.is_relative_to(target):
                how = "contains"
            else:
                continue
            link = f" (through a link, {real})" if real != directory.resolve() else ""
            raise ConfigError(
                f"--out {out} {how} {flag} {directory}{link}: writing the merged checkpoint there would change its "
                "input; choose another --out"
            )


def run(config: MergeLoraConfig) -> int:
    setup_logging(config.log.level)
    if config.adapter == Path() or not config.adapter.is_dir():
        raise ConfigError(f"--adapter {config.adapter}: give the PEFT adapter directory (e.g. <run>/hf/final)")
    if config.out == Path():
        raise ConfigError("set --out, the directory to write the merged checkpoint to")
    check_out(config.out, {"--adapter": config.adapter})
    if config.out.exists() and not config.overwrite:
        raise ConfigError(f"--out {config.out} exists; pass --overwrite to replace it")
    base = _base_dir(config)
    check_out(config.out, {"--base": base})
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
    if bad := next((name for name, param in model.named_parameters() if not all_finite(param)), None):
        raise ConfigError(
            f"merging adapter {config.adapter} ({lora}) into {base} gives NaN or infinite values in {bad} "
            f"({str(dtype).removeprefix('torch.')}); nothing written to --out {config.out}"
        )
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
