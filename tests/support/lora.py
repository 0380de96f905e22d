"""LoRA policies for the serving tests: a base model with adapters that change what it computes."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.models import CausalLM, load_model
from tandem.models.lora import LoraArgs, apply_lora


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
