"""SFT throughput on one GPU: tandem's max-perf recipe against torchtitan, on the same shapes, data and settings.

    python benchmarks/sft_throughput.py --out results.json     # the full run (benchmarks/RESULTS.md)
    python benchmarks/sft_throughput.py --smoke                # tiny shapes, 3 steps each: does everything start?

Shapes (benchmarks/bench_shapes.py): Qwen3-1.7B (`*-dense`), Qwen3-30B-A3B's layers, 6 of 48 (`*-moe`), and
Moonlight-16B-A3B's (DeepSeek-V3 architecture: MLA, sigmoid-routed MoE with shared experts), 4 of 27 (`*-dsv3`).
Each run is a separate process through the trainer's own entry point: `python -m tandem sft @
examples/advanced/<model>/sft-max-perf.toml --data.fake ...` (random init, balanced MoE routing, no final
checkpoint) and `torchrun -m torchtitan.train` with benchmarks/titan_spec.py (torchtitan's Qwen3 or DeepSeek-V3
on the same shape, the same random tokens). Both: bf16 compute, fp32 weights and AdamW state, no activation checkpointing,
blocks compiled with fullgraph=True, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launcher
sets it). Throughput is tokens over wall time of the steps after `--warmup`; memory is the peak the allocator
reserved in those steps (what torchtitan logs). MFU is against 989 TFLOP/s (torchtitan's H100/H200 bf16 peak)
with torchtitan's formula 6·N + 12·L·H·D·S (full, not causal-halved, attention), given twice: N as torchtitan
counts it (a tied LM head is left out) and as tandem counts it (the LM head matmul is in). After the head-to-head
runs come ablations (the recipe with one switch undone) and a profile of tandem's top GPU kernels, as long as
`--budget-s` lasts. The table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from bench_shapes import SHAPES
from gpu_kernels import by_kind, kernel_times

from tandem.jsonl import read_records

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12
RECIPES = {  # by the shape's model_type
    "qwen3": "examples/advanced/qwen3-1.7b/sft-max-perf.toml",
    "qwen3_moe": "examples/advanced/qwen3-moe/sft-max-perf.toml",
    "deepseek_v3": "examples/advanced/deepseek-v3/sft-max-perf.toml",
}
TRAINERS = ("torchtitan", "tandem")
TITAN_LINE = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


@dataclass
class Run:
    name: str
    trainer: str  # "tandem" | "torchtitan"
    shape: str
    batch: int
    seq_len: int
    steps: int
    flags: list[str] = field(default_factory=list)  # extra tandem flags on top of the recipe
    profile: bool = False


@dataclass
class Result:
    run: Run
    tokens_per_s: float = 0.0
    peak_reserved_gib: float = 0.0
    flops_per_token: float = 0.0  # as this trainer counts them
    seconds: float = 0.0
    error: str = ""
    kernel_us_per_step: dict[str, float] = field(default_factory=dict)  # profile runs: GPU time by kernel
    step_ms: list[float] = field(default_factory=list)  # each measured step's wall time


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def _execute(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a trainer in its own process group, so a timeout also ends torchrun's worker (and frees the GPU)."""
    process = subprocess.Popen(
        command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _measured(values: list[dict], warmup: int) -> list[dict]:
    kept = [v for v in values if v["step"] > warmup]
    if not kept:
        raise RuntimeError(f"no steps after the {warmup} warm-up steps")
    return kept


def run_tandem(run: Run, work: Path, warmup: int, timeout: float) -> Result:
    shape = SHAPES[run.shape]
    model_dir = work / f"model-{run.shape}"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(shape.hf_config()))
    recipe = RECIPES[shape.model_type]
    command = [
        sys.executable, "-m", "tandem", "sft", "@", str(ROOT / recipe), "--model.name", str(model_dir), "--random-init",
        "--data.fake", "--seq-len", str(run.seq_len), "--batch-size", str(run.batch), "--micro-batch-size", str(run.batch),
        "--max-steps", str(run.steps), "--speed.no-save-final", "--output-dir", str(work), "--run-name", run.name,
        "--log.level", "warning", *(["--speed.moe-balanced-routing"] if shape.moe else []), *run.flags,
    ]  # fmt: skip
    trace = work / f"{run.name}.trace.json"
    if run.profile:
        command = [sys.executable, str(ROOT / "benchmarks" / "profile_sft.py"), str(warmup), str(trace), *command[4:]]
    out = _execute(command, timeout)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    records = _measured(read_records(work / run.name / "metrics.jsonl"), warmup)
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["step_time_s"] for r in records)
    mfu = records[-1]["mfu"] or 0.0
    result = Result(run, tokens / seconds, max(r["peak_reserved_gib"] or 0.0 for r in records))
    result.flops_per_token = mfu * PEAK_FLOPS / records[-1]["tokens_per_s"]
    result.step_ms = [1e3 * r["step_time_s"] for r in records]
    if run.profile:
        result.kernel_us_per_step = _per_step(kernel_times(trace), run.steps - warmup)
    return result


def _per_step(times: dict[str, float], steps: int) -> dict[str, float]:
    return {name: us / steps for name, us in times.items()}


def run_torchtitan(run: Run, work: Path, warmup: int, timeout: float) -> Result:
    shape = SHAPES[run.shape]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "torchtitan.train",
        "--experimental.custom_import", "titan_spec", "--model.name", shape.titan_spec, "--model.flavor", run.shape,
        "--training.seq_len", str(run.seq_len), "--training.local_batch_size", str(run.batch),
        "--training.steps", str(run.steps), "--training.dtype", "float32", "--training.mixed_precision_param",
        "bfloat16", "--training.max_norm", "1.0", "--optimizer.name", "AdamW", "--optimizer.lr", "1e-5",
        "--optimizer.eps", "1e-8", "--optimizer.weight_decay", "0.0", "--optimizer.implementation", "fused",
        "--lr_scheduler.warmup_steps", "0", "--activation_checkpoint.mode", "none", "--compile.enable",
        "--compile.components", "model,loss", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--job.dump_folder", str(work / run.name), *(["--debug.moe_force_load_balance"] if shape.moe else []),
    ]  # fmt: skip
    if run.profile:  # torchtitan's own profiler: the last step only (its schedule: wait, 1 warm-up, 1 active)
        command += [
            "--profiling.enable_profiling", "--profiling.profile_freq", str(run.steps),
            "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
        ]  # fmt: skip
    out = _execute(command, timeout)
    log = out.stdout + out.stderr
    (work / f"{run.name}.log").write_text(log)
    if out.returncode:
        raise RuntimeError(log[-3000:])
    steps = [
        {"step": int(m[1]), "mem": float(m[2]), "tps": float(m[3].replace(",", "")), "mfu": float(m[4])}
        for m in TITAN_LINE.finditer(log)
    ]
    records = _measured(steps, warmup)
    tokens = run.batch * run.seq_len * len(records)
    result = Result(run, tokens / sum(run.batch * run.seq_len / r["tps"] for r in records))
    result.peak_reserved_gib = max(r["mem"] for r in records)
    result.flops_per_token = records[-1]["mfu"] / 100 * PEAK_FLOPS / records[-1]["tps"]
    result.step_ms = [1e3 * run.batch * run.seq_len / r["tps"] for r in records]
    if run.profile:
        (trace,) = (work / run.name).glob("**/rank0_trace.json")
        result.kernel_us_per_step = _per_step(kernel_times(trace), 1)
    return result


def plan(smoke: bool) -> list[Run]:
    """Head-to-head runs first, then profiles and ablations in the order they are worth device time."""
    if smoke:
        return [
            Run("torchtitan-tiny-moe", "torchtitan", "tiny-moe", 2, 512, 3),
            Run("tandem-tiny-moe", "tandem", "tiny-moe", 2, 512, 3, ["--speed.sync-debug", "error"]),
            Run("tandem-tiny-triton-rope", "tandem", "tiny", 2, 512, 3, ["--speed.rope-kernel", "triton"]),
            Run("torchtitan-tiny-dsv3", "torchtitan", "tiny-dsv3", 2, 512, 3),
            Run("tandem-tiny-dsv3", "tandem", "tiny-dsv3", 2, 512, 3, ["--speed.sync-debug", "error"]),
            Run("tandem-tiny-dsv3-triton-rope", "tandem", "tiny-dsv3", 2, 512, 3, ["--speed.rope-kernel", "triton"]),
        ]
    shapes = {
        "dense": ("qwen3-1.7b", 4, 4096),
        "moe": ("qwen3-30b-a3b-6l", 2, 4096),
        "dsv3": ("moonlight-16b-a3b-4l", 2, 4096),
    }
    runs = [Run(f"{trainer}-{kind}", trainer, *shapes[kind], 12) for kind in shapes for trainer in TRAINERS]
    runs += [
        Run(f"profile-{trainer}-{kind}", trainer, *shapes[kind], 6, profile=True)
        for kind in shapes
        for trainer in TRAINERS[::-1]
    ]
    ablations = [
        ("dense", "-fused-loss", ["--speed.no-fused-loss"]),
        ("dense", "-fused-adamw", ["--speed.no-fused-optimizer"]),
        ("dense", "-cudnn-first", ["--speed.sdpa-backends", "[]"]),
        ("dense", "-with-fsdp", ["--speed.fsdp-single-process"]),
        ("dense", "-triton-rope", ["--speed.rope-kernel", "triton"]),
        ("dense", "-swiglu-kernel", ["--speed.swiglu-kernel", "torch"]),
        ("dense", "-two-loss-chunks", ["--loss-chunk-size", "8192"]),
        ("dense", "-scheduled-gc", ["--gc-interval", "0"]),
        ("dense", "-compile", ["--no-compile"]),
        ("dense", "-lora", ["--model.lora.rank", "16", "--model.lora.alpha", "32"]),
        ("moe", "-with-fsdp", ["--speed.fsdp-single-process"]),
        ("moe", "-fused-loss", ["--speed.no-fused-loss"]),
        ("moe", "-loop-experts", ["--model.moe-backend", "loop", "--no-fullgraph"]),
        ("dsv3", "-triton-rope", ["--speed.rope-kernel", "triton"]),
        ("dsv3", "-swiglu-kernel", ["--speed.swiglu-kernel", "torch"]),
        ("dsv3", "-cudnn-first", ["--speed.sdpa-backends", "[]"]),
        ("dsv3", "-with-fsdp", ["--speed.fsdp-single-process"]),
    ]
    runs += [Run(f"tandem-{kind}{name}", "tandem", *shapes[kind], 8, flags) for kind, name, flags in ablations]
    return runs


def table(results: list[Result]) -> str:
    """One line per run; ratios against torchtitan on the same shape, MFU under both parameter counts."""
    measured = [r for r in results if not r.run.profile]
    titan = {r.run.shape: r for r in measured if r.run.trainer == "torchtitan" and not r.error}
    lines = [f"{'run':30} {'tok/s':>9} {'MFU tt':>7} {'MFU td':>7} {'peak GiB':>9} {'vs titan':>9}  flags"]
    for r in results:
        if r.error:
            lines.append(f"{r.run.name:30} failed: {r.error.strip().splitlines()[-1][:80] if r.error.strip() else '?'}")
            continue
        if r.run.profile:
            continue
        base = titan.get(r.run.shape)
        ours = [x for x in measured if x.run.shape == r.run.shape and x.run.trainer == "tandem" and not x.error]
        counts = {
            "torchtitan": base.flops_per_token if base else None,
            "tandem": ours[0].flops_per_token if ours else None,
        }
        mfu = {k: f"{100 * v * r.tokens_per_s / PEAK_FLOPS:6.1f}%" if v else "    n/a" for k, v in counts.items()}
        ratio = f"{r.tokens_per_s / base.tokens_per_s:8.3f}x" if base else "      n/a"
        lines.append(
            f"{r.run.name:30} {r.tokens_per_s:9,.0f} {mfu['torchtitan']:>7} {mfu['tandem']:>7} "
            f"{r.peak_reserved_gib:9.1f} {ratio}  {' '.join(r.run.flags)}"
        )
    profiles = [r for r in results if r.run.profile and r.kernel_us_per_step]
    for shape in dict.fromkeys(r.run.shape for r in profiles):
        lines += ["", *profile_table([r for r in profiles if r.run.shape == shape])]
    return "\n".join(lines)


def profile_table(profiles: list[Result], top: int = 12) -> list[str]:
    """GPU ms per step by kind of kernel, one column per profile run of a shape; then each run's top kernels."""
    kinds = [by_kind(r.kernel_us_per_step) for r in profiles]
    names = sorted(set().union(*kinds), key=lambda k: -kinds[0][k])
    lines = [
        f"GPU ms per step, {profiles[0].run.shape}:",
        f"{'kind':28}" + "".join(f"{r.run.name:>26}" for r in profiles),
    ]
    for name in [*names, "total"]:
        cells = [sum(k.values()) if name == "total" else k[name] for k in kinds]
        lines.append(f"{name:28}" + "".join(f"{us / 1e3:26.1f}" for us in cells))
    walls = [1e3 * r.run.batch * r.run.seq_len / r.tokens_per_s for r in profiles]
    lines.append(f"{'step wall time (profiled)':28}" + "".join(f"{ms:26.1f}" for ms in walls))
    for r in profiles:
        total = sum(r.kernel_us_per_step.values())
        lines.append(f"top GPU kernels, {r.run.name} (ms per step, share of GPU time):")
        ranked = sorted(r.kernel_us_per_step.items(), key=lambda item: -item[1])[:top]
        lines.extend(f"  {us / 1e3:7.1f} {100 * us / total:5.1f}%  {name[:100]}" for name, us in ranked)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 3 steps: check that every run starts")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the measurement")
    parser.add_argument("--budget-s", type=float, default=480, help="start no run after this many seconds")
    parser.add_argument("--out", type=Path, help="write every result here as JSON")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=None,
        help="only the runs whose names match one of these shell-style patterns, e.g. tandem-dense 'torchtitan-*'",
    )
    args = parser.parse_args()
    warmup = 1 if args.smoke else args.warmup
    start, results = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [r for r in plan(args.smoke) if args.runs is None or any(fnmatch(r.name, p) for p in args.runs)]
        if not runs:
            parser.error(f"no run matches {args.runs}; the runs: {', '.join(r.name for r in plan(args.smoke))}")
        for run in runs:
            left = args.budget_s - (time.monotonic() - start)
            if left < 30:
                print(f"skipped {run.name}: budget spent", flush=True)
                continue
            began = time.monotonic()
            try:
                runner = run_tandem if run.trainer == "tandem" else run_torchtitan
                result = runner(run, Path(tmp), warmup, timeout=left)
            except Exception as error:  # a failed run is reported in the table; the others still run
                result = Result(run, error=f"{type(error).__name__}: {error}")
            result.seconds = time.monotonic() - began
            results.append(result)
            steps = " ".join(f"{ms:.0f}" for ms in result.step_ms)
            status = (
                result.error.strip().splitlines()[-1]
                if result.error.strip()
                else f"{result.tokens_per_s:,.0f} tok/s; step ms: {steps}"
            )
            print(f"{run.name}: {status} ({result.seconds:.0f} s)", flush=True)
    if args.out:
        args.out.write_text(json.dumps([{**vars(r), "run": vars(r.run)} for r in results], indent=1))
    print("\n" + table(results))


if __name__ == "__main__":
    main()
