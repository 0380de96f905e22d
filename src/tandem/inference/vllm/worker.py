"""The vLLM worker extension (`--worker-extension-cls`): load a checkpoint directory into the model in place.

vLLM mixes this class into each of its workers (one per GPU, or the CPU worker); the server reaches it with
`collective_rpc("tandem_load_weights", args=(path,))`. Each worker reads the Hugging Face checkpoint's
safetensors itself (a shared filesystem, as for the trainer's policies) and hands the tensors to vLLM's own
in-place reload, which maps checkpoint names onto vLLM's fused and sharded parameters, so the storage of
every parameter, and with it any CUDA graph, stays valid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the `*.safetensors` files in `path`, one at a time, on CPU; none read from outside `path`."""
    from tandem.models import resolve_inside

    files = [resolve_inside(file, path) for file in sorted(path.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_tensor(name)


def tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose `weight` is the same parameter as an earlier module's (a tied LM head)."""
    owners: set[int] = set()
    tied = []
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) in owners:
            tied.append(module)
        owners.add(id(weight))
    return tied


class WeightLoader:
    """Mixed into vLLM's worker class: `self` is the worker (it has `reload_weights` and `model_runner`)."""

    def tandem_load_weights(self, path: str) -> float:
        """Copy the checkpoint at `path` into the served model; returns the seconds it took."""
        started = time.monotonic()
        self.reload_weights(weights_iterator=checkpoint_tensors(Path(path)))  # type: ignore[attr-defined]
        # vLLM's reload processes a layer only when the checkpoint names its weights, and a tied LM head has none
        # of its own; on CPU, processing packs the weight for the GEMM, so the head would keep the old one.
        for module in tied_modules(self.model_runner.get_model()):  # type: ignore[attr-defined]
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
        return time.monotonic() - started
