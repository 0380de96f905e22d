"""LoRA for the tests: a base model with adapters that change what it computes; adapter directories broken in
every way a loader must refuse."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.models import CausalLM, load_model
from tandem.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraArgs, apply_lora


def adapted_model(path: Path, args: LoraArgs, seed: int) -> CausalLM:
    """The base at `path` (fp32, CPU) with `args`' adapters whose B is random (non-zero): a policy that differs
    from the base (PEFT's init, B zero, would equal it)."""
    model = load_model(path, dtype=torch.float32, device="cpu")
    apply_lora(model, args, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def _config_edit(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        file = path / ADAPTER_CONFIG
        file.write_text(json.dumps(edit(json.loads(file.read_text()))))

    return apply


def _tensor_edit(edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        file = path / ADAPTER_WEIGHTS
        save_file({key: edit(tensor).contiguous() for key, tensor in load_file(file).items()}, file)

    return apply


def _poisoned(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        tensor.view(-1)[-1] = value
        return tensor

    return edit


def _deep(depth: int) -> object:
    value: object = "q_proj"
    for _ in range(depth):
        value = [value]
    return value


BROKEN_ADAPTERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "no-r": (_config_edit(lambda c: {k: v for k, v in c.items() if k != "r"}), r"has no `r`"),
    "r-string": (_config_edit(lambda c: {**c, "r": "four"}), r"r must be an integer, got 'four'"),
    "r-list": (_config_edit(lambda c: {**c, "r": [4]}), r"r must be an integer, got \[4\]"),
    "r-float": (_config_edit(lambda c: {**c, "r": 4.5}), r"r must be an integer"),
    "r-huge": (_config_edit(lambda c: {**c, "r": 10**9}), r"not that of rank 1000000000"),  # before allocating
    "deep-json": (lambda p: (p / ADAPTER_CONFIG).write_text("[" * 100_000 + "]" * 100_000), r"nests too deep"),
    "deep-targets": (_config_edit(lambda c: {**c, "target_modules": _deep(500)}), r"target_modules must be a list"),
    "not-an-object": (_config_edit(lambda c: [4]), r"must hold a JSON object"),
    "alpha-nan": (_config_edit(lambda c: {**c, "lora_alpha": math.nan}), r"alpha must be a positive, finite"),
    "alpha-inf": (_config_edit(lambda c: {**c, "lora_alpha": math.inf}), r"alpha must be a positive, finite"),
    "alpha-string": (_config_edit(lambda c: {**c, "lora_alpha": "16"}), r"lora_alpha must be a number"),
    "alpha-huge": (_config_edit(lambda c: {**c, "lora_alpha": 1e30}), r"scale alpha / rank = .* is over 1000"),
    "nan": (_tensor_edit(_poisoned(math.nan)), r"holds NaN or infinite values"),
    "inf": (_tensor_edit(_poisoned(-math.inf)), r"holds NaN or infinite values"),
    "int64": (_tensor_edit(lambda t: t.to(torch.int64)), r"is int64, not one of float32"),
    "rank-3d": (_tensor_edit(lambda t: t[None]), r"not a matrix"),
}
"""Ways a PEFT adapter directory can be broken, each with what the refusal says (`break_adapter`)."""


def break_adapter(adapter: Path, into: Path, case: str) -> Path:
    """A copy of the adapter directory `adapter` at `into`, broken as `BROKEN_ADAPTERS[case]` says."""
    shutil.copytree(adapter, into)
    BROKEN_ADAPTERS[case][0](into)
    return into
