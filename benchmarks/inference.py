"""Decode throughput and time to first token of the built-in engine, against `transformers` generate on the
same device in the same run, and against the memory-bandwidth roofline.

    python benchmarks/inference.py            # GPU: Qwen3-0.6B- and 1.7B-shaped models, batch 1, 32, 256
    python benchmarks/inference.py --models moonlight-16b-a3b --batches 1 32   # GPU: DeepSeek-V3 architecture
    python benchmarks/inference.py --smoke    # CPU: a tiny model, to check the script works (~1 min)
    python benchmarks/inference.py --smoke --models tiny-dsv3   # CPU: a tiny DeepSeek-V3 (MLA, sigmoid MoE)
    python benchmarks/inference.py --models qwen3-next-80b-a3b-4l nemotron-h-8b-8l   # GPU: the hybrids

Models have random bf16 weights. Every request has a `--prompt-len` prompt and generates exactly
`--gen-len` tokens (greedy, EOS ignored); a batch's prompts are prefilled in one engine step, so the batch
then decodes together. Per run:

- TTFT: mean time from submitting the batch to each request's first token (includes the batch's prefill);
  transformers: `generate(max_new_tokens=1)`.
- decode tok/s: `batch * (gen_len - 1)` tokens over the time from the last first token to the end;
  transformers: the same tokens over `generate(max_new_tokens=gen_len)` minus the `max_new_tokens=1` time.
- roofline: the decode tok/s if each step only read, at the HBM bandwidth measured here (a large device
  copy), every weight once (the embedding table only for the batch's rows when it is not tied to the LM
  head; of an MoE layer's routed experts only as many as the batch's tokens are expected to pick, routing
  uniformly at random) and each sequence's KV cache (MLA: its latent) at the mean decode context
  `prompt_len + gen_len / 2`.

Engine variants: the module-by-module decode step (`torch`) eager and under CUDA graphs (one per batch
bucket), the Triton decode kernels (`triton`, the default on CUDA) under CUDA graphs, with and without
overlapped steps (`overlap_steps`: a step launched before the host reads the last one's tokens), and with
`--compile` the module step compiled (dynamic shapes) under CUDA graphs. The Triton step does not run
multi-head latent attention (DeepSeek-V3) or hybrids, so these get the module step's variants only. Hybrids
(Qwen3-Next, Nemotron-H) run their recurrent layers on the Triton kernels, as `inference.recurrent_kernels =
auto` does on CUDA, and once more on torch ops under CUDA graphs (`torch recurrent layers`), the baseline of
those kernels. The table comes last.
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import (
    MOONLIGHT,
    NEMOTRON_H,
    QWEN3_NEXT,
    SHAPES,
    DeepSeekV3Shape,
    NemotronHShape,
    Qwen3NextShape,
    Qwen3Shape,
    Shape,
)

from tandem.config.inference import InferenceConfig
from tandem.inference.engine import Engine
from tandem.inference.fused_decode import fused_decode_supported
from tandem.inference.kv_budget import state_bytes
from tandem.inference.main import recurrent_kernels
from tandem.inference.outputs import RequestUpdate
from tandem.models import ModelRuntime, build_model
from tandem.models.layers.moe import Experts
from tandem.wire.protocol import SamplingParams

TINY_NEXT = {
    "hidden": 256, "heads": 4, "head_dim": 64, "intermediate": 512, "vocab": 2048, "experts": 8, "top_k": 2,
    "expert_intermediate": 128, "shared_expert_intermediate": 128, "linear_key_heads": 2, "linear_value_heads": 4,
    "linear_key_dim": 64, "linear_value_dim": 64,
}  # fmt: skip
"""Qwen3-Next's layout at tiny widths (--smoke)."""
TINY_NEMOTRON_H = {
    "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512, "vocab": 2048,
    "mamba_heads": 8, "mamba_head_dim": 32, "state_size": 32, "groups": 2,
}  # fmt: skip
"""Nemotron-H's layout at tiny widths (--smoke)."""
MODELS: dict[str, Shape] = {
    # Qwen3-0.6B and Qwen3-1.7B exactly (tied embeddings, 28 layers, 16 query / 8 KV heads of 128).
    "qwen3-0.6b": Qwen3Shape(
        hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936, tied=True
    ),
    "qwen3-1.7b": SHAPES["qwen3-1.7b"],
    # Moonlight-16B-A3B exactly (DeepSeek-V3 architecture, all 27 layers: 16.0B parameters, 3B active; 32 GB in
    # bf16): MLA with a 576-value latent cached per token and layer, 64 experts top-6 + 2 shared.
    "moonlight-16b-a3b": DeepSeekV3Shape(layers=27, **MOONLIGHT),
    # Qwen3-Next-80B-A3B's layers, 4 of its 48 (3 Gated DeltaNet, 1 attention): 8.0B parameters, 16 GB in bf16.
    "qwen3-next-80b-a3b-4l": Qwen3NextShape(layers=4, **QWEN3_NEXT),
    # Nemotron-H-8B's layers, 8 of its 52 in its own order (4 Mamba-2, 3 MLP, 1 attention): 2.1B parameters.
    "nemotron-h-8b-8l": NemotronHShape(layers=8, pattern="M-M-M*-M", **NEMOTRON_H),
    "tiny": SHAPES["tiny"],
    "tiny-dsv3": SHAPES["tiny-dsv3"],
    "tiny-next": Qwen3NextShape(**{**QWEN3_NEXT, **TINY_NEXT}, layers=4),
    "tiny-nemotron-h": NemotronHShape(**{**NEMOTRON_H, **TINY_NEMOTRON_H}, layers=4, pattern="M-M*"),
}
BLOCK_SIZE = 16


@dataclass
class Row:
    model: str
    batch: int
    engine: str
    decode_tok_s: float | None
    ttft_ms: float | None
    note: str = ""
    roofline: float | None = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hbm_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    iters = 10
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * iters / (time.perf_counter() - start)


def roofline_tok_s(model: torch.nn.Module, batch: int, context: float, bandwidth: float) -> float:
    args = model.args
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not args.tie_word_embeddings:  # an untied embedding table is only read for the batch's rows
        embedding = model.embed_tokens.weight
        weights -= (embedding.shape[0] - batch) * embedding.shape[1] * embedding.element_size()
    if args.moe is not None:  # routed experts: only those the batch picks, E * (1 - (1 - k/E)^batch) expected
        untouched = (1 - args.moe.top_k / args.moe.num_experts) ** batch
        experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
        weights -= untouched * sum(p.numel() * p.element_size() for p in experts)
    heads, key_dim, value_dim = args.kv_cache_shape
    element = model.embed_tokens.weight.element_size()
    kv_per_token = len(args.kv_layers) * heads * (key_dim + value_dim) * element
    state = state_bytes(args, 1, model.embed_tokens.weight.dtype)  # a hybrid's recurrent state, read and written
    step_bytes = weights + batch * (context * kv_per_token + 2 * state)
    return batch / (step_bytes / bandwidth)


def run_engine(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[float, float]:
    """(decode tok/s, mean TTFT s) of one batch submitted at once."""
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    first_tokens, finished = [], []
    done = threading.Event()
    lock = threading.Lock()

    def on_update(submitted: float):
        def record(update: RequestUpdate) -> None:
            if update.finished:
                with lock:
                    first_tokens.append(submitted + update.first_token_s)
                    finished.append(time.perf_counter())
                    if len(finished) == len(prompts):
                        done.set()

        return record

    started = time.perf_counter()
    for prompt in prompts:
        engine.submit(prompt, params, on_update(time.perf_counter()))
    if not done.wait(600):
        raise TimeoutError("the engine did not finish the batch within 600 s")
    decode_s = max(finished) - max(first_tokens)
    ttft = sum(first_tokens) / len(first_tokens) - started
    return len(prompts) * (gen_len - 1) / decode_s, ttft


def run_transformers(model: torch.nn.Module, prompts: torch.Tensor, gen_len: int) -> tuple[float, float]:
    """(decode tok/s, TTFT s) of `generate` on the whole batch."""

    def timed(new_tokens: int) -> float:
        sync(prompts.device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, do_sample=False)
        sync(prompts.device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    first = timed(1)
    total = timed(gen_len)
    return prompts.shape[0] * (gen_len - 1) / (total - first), first


def transformers_model(shape: Shape, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in shape.hf_config().items() if k != "architectures"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def bench_model(name: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> list[Row]:
    shape = MODELS[name]
    rows: list[Row] = []
    generator = torch.Generator().manual_seed(0)
    batches = args.batches
    prompts = torch.randint(0, shape.vocab, (max(batches), args.prompt_len), generator=generator)

    def built(recurrent: str = "auto") -> torch.nn.Module:  # the hybrids' layers as `inference.recurrent_kernels`
        options = recurrent_kernels(recurrent, device)
        return build_model(
            shape.hf_config(), dtype=torch.bfloat16, device=device, seed=0, runtime=ModelRuntime(**options)
        )

    model = built()
    context = args.prompt_len + args.gen_len
    torch_step, triton_step = {"decode_kernels": "torch"}, {"decode_kernels": "triton", "cuda_graphs": True}
    variants = [("torch eager", {**torch_step, "cuda_graphs": False})]
    no_triton = fused_decode_supported(model)
    hybrid = model.args.linear is not None or model.args.mamba is not None
    if device.type == "cuda":
        variants += [("torch cuda graphs", {**torch_step, "cuda_graphs": True})]
        if no_triton is None:
            variants += [("triton cuda graphs", triton_step)]
            variants += [("triton cuda graphs, no overlap", {**triton_step, "overlap_steps": False})]
        else:
            print(f"  {name}: no Triton decode variants ({no_triton})", flush=True)
        variants += [("torch cuda graphs + compile", {**torch_step, "compile": True})] if args.compile else []
        variants += (
            [("torch cuda graphs, torch recurrent layers", {**torch_step, "recurrent": "torch"})] if hybrid else []
        )
    for label, overrides in variants:
        if "recurrent" in overrides:  # the same weights (same seed), the recurrent layers on torch ops
            del model
            torch.cuda.empty_cache()
            model = built(overrides.pop("recurrent"))
        graphs = overrides.get("cuda_graphs", True)
        config = InferenceConfig(
            seq_len=context,
            block_size=BLOCK_SIZE,
            kv_cache_blocks=max(batches) * -(-context // BLOCK_SIZE) + 8,
            max_running=max(batches),
            max_prefill_tokens=max(batches) * args.prompt_len,
            cuda_graph_batch_sizes=batches,
            **overrides,
        )
        engine = Engine(model, config).start()
        try:
            started = time.perf_counter()
            for batch in batches:  # warm-up: captures (and compiles) every bucket used below
                run_engine(engine, prompts[:batch].tolist(), 4)
            warmup = time.perf_counter() - started
            note = f"warm-up (capture/compile) {warmup:.0f} s" if graphs else ""
            for batch in batches:
                tok_s, ttft = run_engine(engine, prompts[:batch].tolist(), args.gen_len)
                rows.append(Row(name, batch, f"tandem {label}", tok_s, ttft * 1e3, note))
                print(
                    f"  {name} batch {batch:>3} tandem {label}: {tok_s:,.0f} tok/s, TTFT {ttft * 1e3:.1f} ms",
                    flush=True,
                )
        except Exception as error:  # one variant failing must not lose the others' numbers
            rows.append(Row(name, 0, f"tandem {label}", None, None, f"failed: {type(error).__name__}: {error}"))
            print(f"  {name} tandem {label} failed: {error}", flush=True)
        finally:
            engine.stop()
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del model
    if not args.no_hf:
        hf = transformers_model(shape, device)
        for batch in batches:
            try:
                tok_s, ttft = run_transformers(hf, prompts[:batch].to(device), args.gen_len)
            except torch.OutOfMemoryError:  # its torch paths materialise more than tandem's (Nemotron-H's prefill)
                rows.append(Row(name, batch, "transformers generate", None, None, "out of memory"))
                print(f"  {name} batch {batch:>3} transformers: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(Row(name, batch, "transformers generate", tok_s, ttft * 1e3))
            print(f"  {name} batch {batch:>3} transformers: {tok_s:,.0f} tok/s, TTFT {ttft * 1e3:.1f} ms", flush=True)
        del hf
    roofline_model = build_model(shape.hf_config(), dtype=torch.bfloat16, device="meta")
    mean_context = args.prompt_len + args.gen_len / 2
    for row in rows:
        row.roofline = roofline_tok_s(roofline_model, row.batch, mean_context, bandwidth) if row.batch else None
    return rows


def table(rows: list[Row]) -> str:
    baseline = {(r.model, r.batch): r.decode_tok_s for r in rows if r.engine == "transformers generate"}
    header = ("model", "batch", "engine", "decode tok/s", "TTFT ms", "x transformers", "% roofline", "note")
    lines = [header]
    for r in sorted(rows, key=lambda r: (r.model, r.batch, r.engine != "transformers generate", r.engine)):
        hf = baseline.get((r.model, r.batch))
        lines.append(
            (
                r.model,
                str(r.batch) if r.batch else "-",
                r.engine,
                f"{r.decode_tok_s:,.0f}" if r.decode_tok_s else "-",
                f"{r.ttft_ms:,.1f}" if r.ttft_ms else "-",
                f"{r.decode_tok_s / hf:.2f}" if hf and r.decode_tok_s else "-",
                f"{100 * r.decode_tok_s / r.roofline:.0f}%" if r.roofline and r.decode_tok_s else "-",
                r.note,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i in (0, 2, 7) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, small batches (checks the script)")
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--gen-len", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="add the torch.compile variant (minutes of compiling)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()
    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not smoke:
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    args.models = args.models or (["tiny"] if smoke else ["qwen3-0.6b", "qwen3-1.7b"])
    args.batches = sorted(args.batches or ([1, 4] if smoke else [1, 32, 256]))
    args.prompt_len = args.prompt_len or (16 if smoke else 128)
    args.gen_len = args.gen_len or (8 if smoke else 128)
    bandwidth = hbm_bandwidth(device, 0.0625 if smoke else 4.0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    print(f"{name}, torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s", flush=True)
    print(
        f"prompt {args.prompt_len} tokens, {args.gen_len} generated, bf16, greedy; batches {args.batches}", flush=True
    )
    rows = []
    for model in args.models:
        rows += bench_model(model, args, device, bandwidth)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
