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

RUNTIME_OPTIONS = (
    "attn_backend",
    "moe_backend",
    "freeze_router",
    "moe_balanced_routing",
    "rope_backend",
    "swiglu_backend",
    "index_backend",
    "delta_scan_backend",
    "ssd_backend",
)

ModelArgsLike = ModelArgs | Mapping[str, Any] | str | Path
"""What `model_args` reads a model's shape from: ModelArgs, a `config.json` dict, or a path to a HF directory or
config file (not the `[model]` section users write, `tandem.config.ModelConfig`)."""


def model_args(config: ModelArgsLike, **runtime: Any) -> ModelArgs:
    """ModelArgs from ModelArgs, a `config.json` dict, or a path to a HF directory / config file.

    `runtime` sets options HF configs do not have: attn_backend ("auto" | "sdpa" | "flex"), moe_backend
    (a name from `MOE_BACKENDS`, or one per layer), freeze_router, moe_balanced_routing (benchmarks: every
    expert gets the same number of tokens), rope_backend (a name from `ROPE_BACKENDS`), swiglu_backend (a name
    from `SWIGLU_BACKENDS`), index_backend (a name from `layers.indexer.INDEX_BACKENDS`; DeepSeek-V3.2), delta_scan_backend (a name from
    `layers.gated_deltanet.SCAN_BACKENDS`; Gated DeltaNet), ssd_backend (a name from `layers.mamba2.SSD_BACKENDS`; Mamba-2).
    """
    unknown = set(runtime) - set(RUNTIME_OPTIONS)
    if unknown:
        raise TypeError(f"unknown runtime options {sorted(unknown)}; known: {RUNTIME_OPTIONS}")
    if isinstance(config, str | Path):
        config = read_hf_config(config)
    args = config if isinstance(config, ModelArgs) else get_architecture(config).parse(config)
    return args.replace(**runtime) if runtime else args


def _skeleton(args: ModelArgs, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        return ARCHITECTURES[args.architecture].model_cls(args).to(dtype)


def build_model(
    config: ModelArgsLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    **runtime: Any,
) -> nn.Module:
    """A randomly initialised model (HF's init), or on `device="meta"` an unallocated one to materialise later."""
    args = model_args(config, **runtime)
    dtype = dtype or args.dtype
    model = _skeleton(args.replace(dtype=dtype), dtype)
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
    **runtime: Any,
) -> nn.Module:
    """Load a HF directory (weights required); a config (dict, ModelArgs, config file) gives a random model.

    dtype defaults to the checkpoint's. On `device="meta"` nothing is read; fill it with `load_weights`.
    The source directory is kept as `model.source_dir` so `save_model` can copy the tokenizer.
    """
    if not (isinstance(path_or_config, str | Path) and Path(path_or_config).is_dir()):
        return build_model(path_or_config, dtype=dtype, device=device, **runtime)
    path = Path(path_or_config)
    args = model_args(path, **runtime)
    dtype = dtype or args.dtype
    model = _skeleton(args.replace(dtype=dtype), dtype)
    model.source_dir = path
    if torch.device(device).type != "meta":
        load_weights(model, path, dtype=dtype, device=device)
    return model
