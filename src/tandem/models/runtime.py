"""ModelRuntime: how a model computes, chosen by the run, not by the checkpoint.

`ModelArgs` is what a `config.json` says; two runs of the same checkpoint may still pick different kernels
(attention, MoE, RoPE, SwiGLU, DeepSeek-V3.2's indexer, the hybrid layers' scans) or freeze the router. Those
choices are given to `build_model` / `load_model` as one `ModelRuntime`, kept as `model.runtime`, and read by the
modules when they are built (and by `CausalLM.forward` for the attention backend).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelArgs, ModelConfigError

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


@dataclass(frozen=True)
class ModelRuntime:
    """Runtime choices; the defaults are the reference torch paths. A list `moe_backend` becomes a tuple."""

    attn_backend: str = "auto"  # ATTENTION_BACKENDS: flex on CUDA, sdpa elsewhere under "auto"
    moe_backend: str | tuple[str, ...] = "grouped_mm"  # a name in layers.moe.MOE_BACKENDS, or one per layer
    freeze_router: bool = False  # the router weight gets no gradient (RL's default)
    moe_balanced_routing: bool = False  # benchmarks: round-robin experts, every expert gets the same tokens
    rope_backend: str = "torch"  # a name in layers.rope.ROPE_BACKENDS
    swiglu_backend: str = "torch"  # a name in layers.mlp.SWIGLU_BACKENDS (dense MLPs)
    index_backend: str = "torch"  # a name in layers.indexer.INDEX_BACKENDS (DeepSeek-V3.2's indexer scores)
    delta_scan_backend: str = "torch"  # a name in layers.gated_deltanet.SCAN_BACKENDS (Gated DeltaNet's chunk scan)
    ssd_backend: str = "torch"  # a name in layers.mamba2.SSD_BACKENDS (Mamba-2's within-chunk part)

    def __post_init__(self) -> None:
        if isinstance(self.moe_backend, list):
            object.__setattr__(self, "moe_backend", tuple(self.moe_backend))
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ModelConfigError(f"attn_backend {self.attn_backend!r} is not one of {ATTENTION_BACKENDS}")

    def check(self, args: ModelArgs) -> None:
        """ModelConfigError unless these choices fit the model of `args` (one MoE backend per layer, if a list)."""
        if isinstance(self.moe_backend, tuple) and len(self.moe_backend) != args.num_layers:
            raise ModelConfigError(
                f"moe_backend has {len(self.moe_backend)} entries, expected one per layer ({args.num_layers})"
            )

    def moe_backend_for(self, layer: int) -> str:
        return self.moe_backend[layer] if isinstance(self.moe_backend, tuple) else self.moe_backend
