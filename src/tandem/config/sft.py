"""`tandem sft`: supervised fine-tuning."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from tandem.config.base import Section
from tandem.config.training import TrainingRunConfig


class SftDataConfig(Section):
    path: str = ""
    """Local JSONL file (`prompt`/`completion` or chat `messages` rows) or a Hugging Face dataset name."""
    split: str = "train"
    """Split to read when `path` is a Hugging Face dataset."""
    fake: bool = False
    """Random token rows of seq_len instead of a dataset (benchmarking; no tokenizer needed)."""
    pack: bool = True
    """Pack samples into rows of seq_len tokens (off: one sample per row, padded)."""
    on_bad_row: Literal["skip", "fail"] = "skip"
    """What to do with a row that is malformed, empty or longer than seq_len."""


class DeployConfig(Section):
    nproc: int = Field(1, gt=0)
    """Trainer processes on this machine; above 1, `tandem sft` launches torchrun itself."""


SdpaBackend = Literal["cudnn", "flash", "efficient", "math"]


class SftSpeedConfig(Section):
    """Switches that trade memory or generality for speed; benchmarks/sft_throughput.py measures each one."""

    fused_loss: bool = False
    """SFT loss with its gradient formed in the forward pass (no logits recomputed in backward; +[V, H] fp32)."""
    fused_optimizer: bool = False
    """AdamW as torch's fused kernel over all parameters (fused=True) instead of the foreach loop."""
    sdpa_backends: tuple[SdpaBackend, ...] = ()
    """SDPA kernels to try, in this order (empty: PyTorch's own order), e.g. ["cudnn", "flash"] on Hopper."""
    rope_kernel: Literal["torch", "triton"] = "torch"
    """RoPE as torch ops, or as one Triton kernel (GPU; bit for bit the same result)."""
    swiglu_kernel: Literal["torch", "triton"] = "torch"
    """Dense MLPs' silu(gate) * up as torch ops, or as one Triton kernel forward and one backward (GPU)."""
    moe_balanced_routing: bool = False
    """Benchmarks only: route tokens round-robin so every expert gets the same count (not a real router)."""
    sync_debug: Literal["off", "warn", "error"] = "off"
    """Flag host-device syncs inside steps after the first (torch.cuda.set_sync_debug_mode; GPU only)."""
    save_final: bool = True
    """Write the final training checkpoint and Hugging Face export (benchmarks turn this off)."""
    fsdp_single_process: bool = True
    """One process in FSDP2 as on several; off: a plain module under autocast, no FSDP copies (torchtitan's 1-GPU way)."""


class SftConfig(TrainingRunConfig):
    command: ClassVar[str] = "sft"

    batch_size: int = Field(8, gt=0)
    """Rows of seq_len tokens per optimizer step, across all ranks."""
    micro_batch_size: int = Field(1, gt=0)
    """Rows per forward/backward pass on one rank (gradient accumulation fills the rest)."""
    data: SftDataConfig = SftDataConfig()
    """Training data."""
    deploy: DeployConfig = DeployConfig()
    """Processes to launch."""
    speed: SftSpeedConfig = SftSpeedConfig()
    """Throughput switches (examples/advanced/*/sft-max-perf.toml turns them on)."""
    overwrite: bool = Field(False, exclude=True)
    """Start over in a run directory that holds an earlier run, deleting it first (never saved with the config)."""
