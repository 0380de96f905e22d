"""What every training command shares: steps, seed, model build switches, optimizer, checkpoints, monitoring."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import Section
from tandem.config.common import OptimConfig, RunConfig, SchedulerConfig


class CheckpointConfig(Section):
    interval: int = Field(0, ge=0)
    """Write a full training checkpoint every this many steps (0: only at the end)."""
    keep: int = Field(2, gt=0)
    """How many of the newest training checkpoints to keep."""
    hf_interval: int = Field(0, ge=0)
    """Also export a Hugging Face checkpoint every this many steps (0: only at the end)."""


class ResumeConfig(Section):
    enabled: bool = False
    """Resume from a training checkpoint of this run (`--resume`)."""
    step: int | None = None
    """Resume from this step's checkpoint instead of the latest (`--resume.step N`)."""

    @model_validator(mode="after")
    def _step_implies_enabled(self) -> ResumeConfig:
        if self.step is not None and not self.enabled:
            self.enabled = True
        return self


class WandbConfig(Section):
    enabled: bool = False
    """Log metrics to Weights & Biases (needs the `wandb` extra)."""
    project: str = "tandem"
    """W&B project name."""


SdpaBackend = Literal["cudnn", "flash", "efficient", "math"]


class SpeedConfig(Section):
    """Switches that trade memory or generality for speed, the same for SFT and the RL trainer;
    benchmarks/sft_throughput.py and benchmarks/rl_throughput.py measure them."""

    fused_loss: bool = False
    """The loss with its gradient formed in the forward pass, chunk by chunk (no logits recomputed in backward; +[V, H] fp32): SFT's summed NLL, or RL's policy loss (every loss type, per-token temperatures, replayed kept ids, entropy)."""
    fused_optimizer: bool = False
    """AdamW as torch's fused kernel over all parameters (fused=True) instead of the foreach loop."""
    sdpa_backends: tuple[SdpaBackend, ...] = ()
    """SDPA kernels to try, in this order (empty: PyTorch's own order), e.g. ["cudnn", "flash"] on Hopper."""
    rope_kernel: Literal["torch", "triton"] = "torch"
    """RoPE as torch ops, or as one Triton kernel (GPU; bit for bit the same result)."""
    swiglu_kernel: Literal["torch", "triton"] = "torch"
    """Dense MLPs' silu(gate) * up as torch ops, or as one Triton kernel forward and one backward (GPU)."""
    index_kernel: Literal["torch", "triton"] = "torch"
    """DeepSeek-V3.2's indexer scores as torch ops, or as one tiled Triton kernel (GPU; other models ignore it)."""
    delta_scan_kernel: Literal["auto", "torch", "triton"] = "auto"
    """Gated DeltaNet's pass over chunks (Qwen3-Next, Qwen3.5) as a Python loop of matmuls (torch), or as one Triton kernel each way (triton; GPU; 3-7x the layer's speed); auto: triton on CUDA (torch with compile and fullgraph: the kernel is a graph break). Other models ignore it."""
    ssd_kernel: Literal["auto", "torch", "triton"] = "auto"
    """Mamba-2's within-chunk part (Nemotron-H) as torch einsums over [chunk, chunk] scores (torch), or as Triton kernels that keep them in registers (triton; GPU; faster, less memory); auto: triton on CUDA (torch with compile and fullgraph). Other models ignore it."""
    moe_balanced_routing: bool = False
    """Benchmarks only: route tokens round-robin so every expert gets the same count (not a real router; in RL the trainer then scores another policy than inference samples)."""
    sync_debug: Literal["off", "warn", "error"] = "off"
    """Flag host-device syncs inside steps after the first, from reading the batch to the optimizer step (torch.cuda.set_sync_debug_mode; GPU only)."""
    save_final: bool = True
    """Write the final training checkpoint, and for SFT the Hugging Face export hf/final (benchmarks turn this off). The RL trainer writes its last policy as a directory either way: it is the run's result."""
    fsdp_single_process: bool = True
    """One process in FSDP2 as on several; off: a plain module under autocast, no FSDP copies (torchtitan's 1-GPU way). Several processes shard anyway."""


class TrainingRunConfig(RunConfig):
    """The root of `tandem sft` and `tandem trainer`; `tandem rl` holds the latter as `trainer`."""

    max_steps: int = Field(100, gt=0)
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed for initialisation and data order."""
    random_init: bool = False
    """Initialise the weights randomly from the model's config.json instead of loading them."""
    compile: bool = False
    """torch.compile each decoder block."""
    fullgraph: bool = True
    """Compile blocks with fullgraph=True (fail on graph breaks rather than fall back)."""
    activation_checkpointing: Literal["off", "full", "selective"] = "off"
    """Recompute activations in backward: every block (full), every other block (selective), or none."""
    loss_chunk_size: int = Field(1024, gt=0)
    """Tokens per chunk in the chunked logprobs (bounds the logits held in memory)."""
    log_interval: int = Field(1, gt=0)
    """Print a log line every this many steps (metrics.jsonl gets every step)."""
    gc_interval: int = Field(50, ge=0)
    """Run Python's garbage collector every this many steps, not whenever it likes, as torchtitan does (0: Python's own)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    resume: ResumeConfig = ResumeConfig()
    """Resuming a killed run."""
    wandb: WandbConfig = WandbConfig()
    """Optional W&B monitoring."""
    speed: SpeedConfig = SpeedConfig()
    """Throughput switches (examples/advanced/*/sft-max-perf.toml turns them on)."""
