"""Batch-1 linear layers of a decode step: tandem's Triton GEMV (every candidate tile) against cuBLAS (`F.linear`).

    python benchmarks/gemv.py          # GPU: every projection of Qwen3-0.6B and 1.7B, one row

Each kernel is captured in a CUDA graph, as the engine runs it, cycling through enough copies of the weight
(at least 256 MB) that no copy is still in L2 when it is read again, as in a real step where every layer has
its own weights. Bandwidth is the weight's bytes over the time per call. The table (last) gives cuBLAS's time,
the best tile's, the speed-up, and the largest difference from cuBLAS's output.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tandem.kernels.gemv import CONFIGS, gemv

# (model, layer, out_features, in_features)
SHAPES = [
    ("qwen3-0.6b", "qkv", 4096, 1024),
    ("qwen3-0.6b", "o", 1024, 2048),
    ("qwen3-0.6b", "gate_up", 6144, 1024),
    ("qwen3-0.6b", "down", 1024, 3072),
    ("qwen3-0.6b", "lm_head", 151936, 1024),
    ("qwen3-1.7b", "qkv", 4096, 2048),
    ("qwen3-1.7b", "o", 2048, 2048),
    ("qwen3-1.7b", "gate_up", 12288, 2048),
    ("qwen3-1.7b", "down", 2048, 6144),
    ("qwen3-1.7b", "lm_head", 151936, 2048),
]
CYCLE_BYTES = 256 * 2**20


def time_per_call_us(fn, weights: list[torch.Tensor], repeats: int = 5) -> float:
    """Mean time of `fn(weight)` over a CUDA graph that calls it once per weight copy, `repeats` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for weight in weights[:2]:
            fn(weight)  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for weight in weights:
                fn(weight)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (5 * repeats * len(weights)) * 1e6


def main() -> None:
    torch.manual_seed(0)
    header = (
        "model",
        "layer",
        "MB",
        "cuBLAS us",
        "GEMV us",
        "cuBLAS GB/s",
        "GEMV GB/s",
        "speed-up",
        "max diff",
        "tile",
    )
    lines = [header]
    for model, layer, out_features, in_features in SHAPES:
        size = out_features * in_features * 2
        copies = max(2, -(-CYCLE_BYTES // size))
        weights = [
            torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
        cublas = time_per_call_us(lambda w, x=x: F.linear(x, w), weights)
        times = {c: time_per_call_us(lambda w, x=x, c=c: gemv(x, w, config=c), weights) for c in CONFIGS}
        best = min(times, key=times.get)
        diff = (gemv(x, weights[0], config=best).float() - F.linear(x, weights[0]).float()).abs().max().item()
        tile = "{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**best.all_kwargs())
        lines.append(
            (model, layer, f"{size / 1e6:.1f}", f"{cublas:.2f}", f"{times[best]:.2f}", f"{size / cublas / 1e3:,.0f}",
             f"{size / times[best] / 1e3:,.0f}", f"{cublas / times[best]:.2f}x", f"{diff:.1e}", tile)
        )  # fmt: skip
        print(
            f"{model} {layer}: "
            + ", ".join(f"{k.all_kwargs()['BLOCK_N']}x{k.all_kwargs()['BLOCK_K']}:{v:.1f}" for k, v in times.items()),
            flush=True,
        )
        del weights
        torch.cuda.empty_cache()
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines))


if __name__ == "__main__":
    main()
