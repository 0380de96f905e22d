"""Per-step training metrics: throughput, MFU, memory; written to metrics.jsonl and shown live."""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch

from tandem.jsonl import JsonlWriter, keep_steps_up_to

logger = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s by device name fragment (the torchtitan convention: no sparsity).
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in name), None)


def flops_per_token(non_embedding_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token as torchtitan counts them: 6·N plus 12·L·H·D·S for attention.

    N counts non-embedding parameters (for MoE, only the experts a token is routed to); the
    attention term is the full S×S score matrix (no causal halving), as torchtitan does.
    """
    return 6 * non_embedding_params + 12 * num_layers * num_heads * head_dim * seq_len


class MetricsWriter(JsonlWriter):
    """metrics.jsonl (rank 0 only), one line per step: a fresh run starts it empty; a run resumed from step N's
    checkpoint keeps the steps up to N, so no step is counted twice, and its first record (step N+1) says
    `"resumed_from": N`, so the file itself tells where the run resumed (the dashboard marks it on its charts)."""

    def __init__(self, path: Path, resume_step: int = 0):
        if resume_step:
            keep_steps_up_to(path, resume_step)
        super().__init__(path, truncate=not resume_step)
        self._resumed_from = resume_step or None

    def write(self, record: dict[str, Any]) -> None:
        if self._resumed_from is not None:
            record = {**record, "resumed_from": self._resumed_from}
            self._resumed_from = None
        super().write(record)


class StepTimer:
    """Wall time of a step, synchronising the device only at the step boundary."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


def peak_reserved_gib(device: torch.device) -> float | None:
    """Peak memory the CUDA caching allocator held since the last reset (what torchtitan logs), or None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def peak_memory_gib(device: torch.device) -> float:
    """Peak tensor memory on a GPU since the last reset; on CPU, the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
