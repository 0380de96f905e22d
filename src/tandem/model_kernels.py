"""Which Triton kernels the models run: the trainer's `speed.*_kernel` switches and the engine's prefill kernels
become the models' `*_backend` runtime options, and the kernels are registered in the models' backend tables
(`tandem.models` never imports a kernel)."""

from __future__ import annotations

import torch

from tandem.config import ConfigError
from tandem.kernels import triton_unavailable_reason
from tandem.models.layers.gated_deltanet import SCAN_BACKENDS, STEP_BACKENDS
from tandem.models.layers.indexer import INDEX_BACKENDS
from tandem.models.layers.mamba2 import SSD_BACKENDS, SSD_STEP_BACKENDS
from tandem.models.layers.mlp import SWIGLU_BACKENDS
from tandem.models.layers.rope import ROPE_BACKENDS


def resolve(kernel: str, device: torch.device) -> str:
    """A kernel switch's choice: "auto" is "triton" on CUDA with Triton installed, else "torch"."""
    if kernel != "auto":
        return kernel
    return "triton" if device.type == "cuda" and triton_unavailable_reason("cuda") is None else "torch"


def kernel_options(
    device: torch.device,
    rope: str = "torch",
    swiglu: str = "torch",
    index: str = "torch",
    delta_scan: str = "torch",
    ssd: str = "torch",
) -> dict[str, str]:
    """The models' `rope_backend`, `swiglu_backend`, `index_backend`, `delta_scan_backend` and `ssd_backend`
    runtime options from the `speed.*_kernel` switches; the Triton kernels, which models may not import, are
    registered here. A switch may say "auto" (`resolve`). A ConfigError names the switches when Triton cannot run
    on `device`."""
    switches = {"rope": rope, "swiglu": swiglu, "index": index, "delta_scan": delta_scan, "ssd": ssd}
    kernels = {name: resolve(kernel, device) for name, kernel in switches.items()}
    triton = [name for name, kernel in kernels.items() if kernel == "triton"]
    reason = triton_unavailable_reason(device.type) if triton else None
    if reason is not None:
        raise ConfigError(f"{' and '.join(f'speed.{name}_kernel' for name in triton)} = triton: {reason}")
    if "rope" in triton and "triton" not in ROPE_BACKENDS:
        from tandem.kernels.rope import apply_rope_triton

        ROPE_BACKENDS["triton"] = apply_rope_triton
    if "swiglu" in triton and "triton" not in SWIGLU_BACKENDS:
        from tandem.kernels.swiglu import swiglu as swiglu_triton

        SWIGLU_BACKENDS["triton"] = swiglu_triton
    if "index" in triton and "triton" not in INDEX_BACKENDS:
        from tandem.kernels.indexer import index_scores_triton

        INDEX_BACKENDS["triton"] = index_scores_triton
    if "delta_scan" in triton and "triton" not in SCAN_BACKENDS:
        from tandem.kernels.delta_scan import delta_chunk_scan_triton, gated_delta_step_triton

        SCAN_BACKENDS["triton"], STEP_BACKENDS["triton"] = delta_chunk_scan_triton, gated_delta_step_triton
    if "ssd" in triton and "triton" not in SSD_BACKENDS:
        from tandem.kernels.ssd import intra_chunk_ssd_triton, ssd_step_triton

        SSD_BACKENDS["triton"], SSD_STEP_BACKENDS["triton"] = intra_chunk_ssd_triton, ssd_step_triton
    return {f"{name}_backend": kernel for name, kernel in kernels.items()}
