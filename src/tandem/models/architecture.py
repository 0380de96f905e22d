"""What the registry holds for one Hugging Face architecture: how to parse its config and name its weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import ModelArgs
from .decoder import CausalLM
from .hf_layout import HFLayout
from .runtime import ModelRuntime


@dataclass(frozen=True)
class Architecture:
    """A registered Hugging Face architecture: its config parser, model class and checkpoint names."""

    hf_name: str  # `architectures[0]` in config.json
    parse: Callable[[Mapping[str, Any]], ModelArgs]
    model_cls: Callable[[ModelArgs, ModelRuntime], nn.Module] = CausalLM
    layout: HFLayout = field(default_factory=HFLayout)
