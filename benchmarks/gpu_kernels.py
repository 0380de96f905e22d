"""GPU time per kernel and per kind of kernel, read from a torch.profiler Chrome trace.

tandem's profile runs (`profile_sft.py`) and torchtitan's (its `--profiling.*` options) both write one, so the
two trainers' steps are split into the same kinds by the same rules and can be compared row by row.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

DEVICE_EVENTS = {"kernel", "gpu_memcpy", "gpu_memset"}
KINDS = [  # first match wins
    (
        "attention backward",
        r"(flash|fmha|sdpa|attn).*(bwd|bprop|backward)|(bwd|bprop|backward).*(flash|fmha|sdpa)|dot_do_o|convert_dq",
    ),
    ("attention forward", r"flash|fmha|sdpa|attn"),
    ("GEMM", r"nvjet|gemm|cutlass|xmma|cublas|splitk"),
    ("optimizer and grad norm", r"adam|multi_tensor|foreach|lpnorm"),
    ("compiled by inductor", r"^triton_"),
    ("tandem's Triton kernels", r"^_\w+_kernel$"),
    ("copies, casts and memsets", r"memcpy|memset|copy_kernel|chunk_cat"),
]


def kernel_times(trace: Path) -> Counter:
    """Summed duration (µs) of each device kernel, copy and memset in the trace, by name."""
    events = json.loads(trace.read_text())["traceEvents"]
    times: Counter = Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in DEVICE_EVENTS:
            times[event["name"]] += float(event["dur"])
    if not times:
        raise ValueError(f"{trace} has no GPU events (was the profiler's CUDA activity on?)")
    return times


def kind(name: str) -> str:
    lowered = name.lower()
    return next((label for label, pattern in KINDS if re.search(pattern, lowered)), "other")


def by_kind(times: Counter) -> Counter:
    kinds: Counter = Counter()
    for name, us in times.items():
        kinds[kind(name)] += us
    return kinds
