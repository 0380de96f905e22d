"""Where a decode step's time goes: kernels per step, their summed GPU time, and the CUDA-graph replay, against
the HBM roofline of the same step.

    python benchmarks/decode_profile.py                  # GPU: Qwen3-0.6B and 1.7B shapes, batch 1 and 32
    python benchmarks/decode_profile.py --models qwen3-0.6b --batches 1 --steps triton

One engine decode step (256-token key capacity, random bf16 weights), module by module (`decode.decode_step`,
`torch`) and on the Triton decode kernels (`fused_decode.fused_decode_step`, `triton`: at batch 1 on
tandem's fused GEMVs; `triton-cublas`: on cuBLAS's at every batch; `triton-attn1` / `triton-attn3`: `triton` with
qk-norm + RoPE + cache write, attention and the split combine as one kernel, `kernels.decode.decode_attention`,
or as three, at every batch), is profiled eagerly
with torch.profiler (kernel count and the sum of the kernels' own durations: the GPU work, without launch gaps),
then captured as a CUDA graph and replayed (wall time per replay). If the replay takes about the summed kernel
time, the step is bound by its kernels; the roofline is the weights read once over the copy bandwidth measured
here. `--gemv-tiles` runs each triton step again with every batch-1 GEMV on one fixed tile instead of the
autotuned ones; `max diff` is the largest difference of a row's logits from the first row's of the same model
and batch. The top kernels of the step come after the table.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tandem.kernels.gemv as gemv_kernels
from inference import MODELS, hbm_bandwidth
from tandem.inference.cuda_graphs import GraphedDecoder
from tandem.inference.decode import EagerDecoder, StepFunction, decode_step
from tandem.inference.fused_decode import fused_decode_step
from tandem.models import KVCache, build_model

BLOCK_SIZE, KEY_CAPACITY = 16, 256
STEPS: dict[str, StepFunction] = {
    "torch": decode_step,
    "triton": fused_decode_step,
    "triton-cublas": functools.partial(fused_decode_step, one_row_gemv=False),
    "triton-attn1": functools.partial(fused_decode_step, fused_attention=True),
    "triton-attn3": functools.partial(fused_decode_step, fused_attention=False),
}


AUTOTUNED_GEMV = gemv_kernels._gemv_autotuned
TILE = re.compile(r"(\d+)x(\d+)w(\d+)")


def gemv_tile(text: str) -> str | None:
    """`--gemv-tiles` values: `NxKwW` (BLOCK_N, BLOCK_K, warps), or `auto` (None)."""
    if text != "auto" and TILE.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"a GEMV tile is NxKwW (e.g. 8x1024w4) or auto, got {text!r}")
    return None if text == "auto" else text


def force_gemv_tile(tile: str | None) -> None:
    """Run every batch-1 GEMV on `tile` instead of the autotuned one; None: back to the autotuned one (and
    its cached choices)."""
    autotuned = AUTOTUNED_GEMV
    if tile is not None:
        n, k, warps = (int(part) for part in TILE.fullmatch(tile).groups())
        config = triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps)
        autotuned = triton.autotune([config], key=["N", "K", "NORM", "SWIGLU"])(gemv_kernels._gemv_kernel)
    gemv_kernels._gemv_autotuned = autotuned


def profile(
    name: str, batch: int, step: str, tile: str | None, bandwidth: float
) -> tuple[list[str], Counter, torch.Tensor]:
    shape = MODELS[name]
    model = build_model(shape.hf_config(), dtype=torch.bfloat16, device="cuda", seed=0).eval()
    args = model.args
    blocks = KEY_CAPACITY // BLOCK_SIZE
    cache = KVCache(
        args.num_layers, batch * blocks + 1, BLOCK_SIZE, args.num_kv_heads, args.head_dim, torch.bfloat16, "cuda"
    )
    tables = [[1 + row * blocks + b for b in range(blocks)] for row in range(batch)]
    tokens, lengths = [1] * batch, [KEY_CAPACITY // 2] * batch
    step_fn = STEPS[step]
    force_gemv_tile(tile)
    eager = EagerDecoder(model, cache, step_fn)
    graphed = GraphedDecoder(model, cache, [batch], blocks, step_fn)
    with torch.inference_mode():
        for _ in range(3):
            eager(tokens, lengths, tables)
            graphed(tokens, lengths, tables)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eager(tokens, lengths, tables)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
        top = Counter()
        for e in kernels:
            top[e.name] += e.time_range.elapsed_us()
        iters = 50
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            graphed(tokens, lengths, tables)
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - start) / iters * 1e3
        logits = graphed(tokens, lengths, tables).float().cpu()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    roofline_ms = weights / bandwidth * 1e3
    row = [
        name,
        str(batch),
        step if tile is None else f"{step} {tile}",
        str(len(kernels)),
        f"{len(kernels) / args.num_layers:.0f}",
        f"{kernel_ms:.3f}",
        f"{replay_ms:.3f}",
        f"{roofline_ms:.3f}",
        f"{100 * roofline_ms / replay_ms:.0f}%",
    ]
    total = sum(top.values())
    return row, Counter({k: 100 * v / total for k, v in top.items()}), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=sorted(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument(
        "--gemv-tiles",
        nargs="+",
        type=gemv_tile,
        default=[None],
        help="run each triton step's batch-1 GEMVs on each of these tiles, NxKwW (e.g. 8x1024w4), or auto",
    )
    args = parser.parse_args()
    bandwidth = hbm_bandwidth(torch.device("cuda"), 4.0)
    header = ["model", "batch", "step", "kernels", "per layer", "kernel ms", "replay ms", "roofline ms", "% roof"]
    header.append("max diff")  # of the logits from the first step's of the same model and batch
    rows, tops = [header], []
    for name in args.models:
        for batch in args.batches:
            first = None
            for step, tile in [(s, t) for s in args.steps for t in args.gemv_tiles]:
                if tile is not None and not step.startswith("triton"):
                    continue
                row, top, logits = profile(name, batch, step, tile, bandwidth)
                first = logits if first is None else first
                row.append(f"{(logits - first).abs().max().item():.1e}")
                rows.append(row)
                tops.append((f"{name} batch {batch}, {row[2]} step", top))
                torch.cuda.empty_cache()
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows))
    for label, top in tops:
        print(f"\ntop kernels of one eager decode step, {label} (share of summed kernel time):")
        for kernel, share in top.most_common(8):
            print(f"  {share:5.1f}%  {kernel[:100]}")


if __name__ == "__main__":
    main()
