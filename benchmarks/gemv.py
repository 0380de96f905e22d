"""Small-batch linear layers of a decode step: tandem's Triton GEMV against cuBLAS (`F.linear`) in the same run.

    python benchmarks/gemv.py                    # GPU: every linear of Qwen3-0.6B and 1.7B, rows 1, 2, 4, 8

Each kernel is timed replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`), as the engine runs it;
bandwidth is the weight's bytes over that time. Every GEMV tile shape in `TILES` is timed; the best is reported with its tile, and `default_tile`'s time.
The table (last) gives both times, the GEMV's speed-up over cuBLAS, and its largest difference from cuBLAS.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from tandem.kernels.gemv import TILES, default_tile, gemv

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    args = parser.parse_args()
    torch.manual_seed(0)
    header = (
        "model",
        "layer",
        "rows",
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
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            diff = (gemv(x, weight).float() - F.linear(x, weight).float()).abs().max().item()
            cublas = do_bench_cudagraph(lambda x=x, w=weight: F.linear(x, w)) * 1e3
            times = {tile: do_bench_cudagraph(lambda x=x, w=weight, t=tile: gemv(x, w, tile=t)) * 1e3 for tile in TILES}
            tile = min(times, key=times.get)
            ours = times[tile]
            default = do_bench_cudagraph(lambda x=x, w=weight: gemv(x, w)) * 1e3
            gigabytes = weight.numel() * weight.element_size() / 1e9
            lines.append(
                (
                    model,
                    layer,
                    str(rows),
                    f"{cublas:.1f}",
                    f"{ours:.1f}",
                    f"{gigabytes / cublas * 1e6:,.0f}",
                    f"{gigabytes / ours * 1e6:,.0f}",
                    f"{cublas / ours:.2f}x",
                    f"{diff:.1e}",
                    "x".join(map(str, tile)),
                    "x".join(map(str, default_tile(rows, out_features, x.device))),
                    f"{default:.1f}",
                )
            )
            print("  ".join(lines[-1]), flush=True)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print()
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines))


if __name__ == "__main__":
    main()
