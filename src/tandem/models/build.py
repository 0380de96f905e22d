"""Entry points that turn a config or a HF directory into a model: `model_args`, `build_model`, `load_model`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import load_weights
from .config import ModelArgs, read_hf_config
from .registry import ARCHITECTURES, get_architecture
from .runtime import ModelRuntime

ModelArgsLike = ModelArgs | Mapping[str, Any] | str | Path
"""What `model_args` reads a model's shape from: ModelArgs, a `config.json` dict, or a path to a HF directory or
config file (not the `[model]` section users write, `tandem.config.ModelConfig`)."""


def model_args(config: ModelArgsLike) -> ModelArgs:
    """ModelArgs from ModelArgs, a `config.json` dict, or a path to a HF directory / config file."""
    if isinstance(config, str | Path):
        config = read_hf_config(config)
    return config if isinstance(config, ModelArgs) else get_architecture(config).parse(config)


def _skeleton(args: ModelArgs, dtype: torch.dtype, runtime: ModelRuntime | None) -> nn.Module:
    runtime = runtime or ModelRuntime()
    runtime.check(args)
    with torch.device("meta"):
        return ARCHITECTURES[args.architecture].model_cls(args, runtime).to(dtype)


def build_model(
    config: ModelArgsLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    runtime: ModelRuntime | None = None,
) -> nn.Module:
    """A randomly initialised model (HF's init), or on `device="meta"` an unallocated one to materialise later.

    `dtype` defaults to the config's; `runtime` (default `ModelRuntime()`) picks the kernels (`model.runtime`).
    """
    args = model_args(config)
    dtype = dtype or args.dtype
    model = _skeleton(args, dtype, runtime)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    model.init_weights(generator)
    return model


def load_model(
    path_or_config: ModelArgsLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    runtime: ModelRuntime | None = None,
) -> nn.Module:
    """Load a HF directory (weights required); a config (dict, ModelArgs, config file) gives a random model.

    dtype defaults to the checkpoint's. On `device="meta"` nothing is read; fill it with `load_weights`.
    The source directory is kept as `model.source_dir` so `save_model` can copy the tokenizer.
    """
    if not (isinstance(path_or_config, str | Path) and Path(path_or_config).is_dir()):
        return build_model(path_or_config, dtype=dtype, device=device, runtime=runtime)
    path = Path(path_or_config)
    args = model_args(path)
    dtype = dtype or args.dtype
    model = _skeleton(args, dtype, runtime)
    model.source_dir = path
    if torch.device(device).type != "meta":
        load_weights(model, path, dtype=dtype, device=device)
    return model
