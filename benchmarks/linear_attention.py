"""The hybrid families' recurrent layers on one GPU: tandem's Gated DeltaNet (Qwen3-Next's `linear_attn`) and
Mamba-2 (Nemotron-H's `mixer`) in their chunked form, against their recurrent reference and transformers' own
layer on the same weights, forward + backward tokens/s.

    python benchmarks/linear_attention.py --smoke      # CPU, tiny layers: does every part run?
    TRITON_INTERPRET=1 python benchmarks/linear_attention.py --smoke   # the Triton kernels too, interpreted
    python benchmarks/linear_attention.py              # GPU: one layer of Qwen3-Next-80B-A3B and of Nemotron-H-8B

Each layer is built from a one-layer Hugging Face config of the family (random weights, bf16), transformers' layer
first, then tandem's with the same state dict. A run is one sequence of `--tokens` (4K and 16K by default): x
`[1, T, hidden]` through the layer, `out.float().square().mean()` backward, timed over `--iters` after a warm-up.
transformers runs its plain-torch path (`torch_chunk_gated_delta_rule`, Mamba-2's `torch_forward`): the fast
paths need flash-linear-attention, causal-conv1d or mamba_ssm, none of which is a tandem dependency. The
recurrent reference (token by token, the decode step's form) runs at the smallest length only. tandem also runs
a packed row of the same length, 8 documents, state reset at each start (transformers cannot keep them apart),
and on a GPU the Triton kernels: Gated DeltaNet's pass over chunks (`speed.delta_scan_kernel`, triton) instead of
the Python loop, Mamba-2's within-chunk part (`speed.ssd_kernel`, triton) instead of the einsums.

Columns: tokens/s and the ratio to transformers at the same length, the peak GPU memory of the step; the max abs
difference of the forward against transformers' (bf16 weights, fp32 scan) says they computed the same thing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.models import build_model
from tandem.models.layers.attention import AttnInputs
from tandem.models.layers.gated_deltanet import SCAN_BACKENDS, recurrent_gated_delta_rule
from tandem.models.layers.mamba2 import KERNEL_CHUNK, SSD_BACKENDS, recurrent_ssd

# One linear-attention layer of Qwen3-Next-80B-A3B (hidden 2048; 16 key heads, 32 value heads of 128; conv 4).
QWEN3_NEXT_LAYER = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 256, "rms_norm_eps": 1e-6,
}  # fmt: skip
# One Mamba-2 layer of Nemotron-H-8B (hidden 4096; 128 heads of 64, state 128, 8 groups, chunks of 128).
NEMOTRON_H_LAYER = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
    "hybrid_override_pattern": "M", "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 21504, "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128,
    "n_groups": 8, "chunk_size": 128, "conv_kernel": 4, "vocab_size": 256, "tie_word_embeddings": False,
}  # fmt: skip
SMOKE_SIZES = {
    "qwen3_next": {"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_attention_heads": 4, "head_dim": 16},
    "nemotron_h": {"hidden_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 2, "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}  # fmt: skip


def layers(config: dict, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' recurrent layer and tandem's, on `device` in bf16, with the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    block = hf.model.layers[0] if hasattr(hf, "model") else hf.backbone.layers[0]
    theirs = block.linear_attn if config["model_type"] == "qwen3_next" else block.mixer
    ours = build_model(config, dtype=torch.bfloat16, device=device, seed=0).layers[0].mixer
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def reference(ours: torch.nn.Module, model_type: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """tandem's layer with the scan token by token (`recurrent_gated_delta_rule` / `recurrent_ssd`)."""
    module = sys.modules[type(ours).__module__]
    name, recurrent = (
        ("chunk_gated_delta_rule", recurrent_gated_delta_rule)
        if model_type == "qwen3_next"
        else ("chunk_ssd", recurrent_ssd)
    )
    chunked = getattr(module, name)

    def run(x: torch.Tensor) -> torch.Tensor:
        setattr(module, name, lambda *a, chunk_size=None, scan=None, intra=None, **k: recurrent(*a, **k))
        try:
            return ours(x, None, None, AttnInputs())
        finally:
            setattr(module, name, chunked)

    return run


def with_kernels(ours: torch.nn.Module, attn: AttnInputs) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer with its Triton kernels, as the `speed.*_kernel = triton` switches build it: Gated DeltaNet's
    pass over chunks, Mamba-2's within-chunk part (in chunks of `KERNEL_CHUNK`)."""
    switches = {"scan": "triton"} if hasattr(ours, "scan") else {"ssd": "triton", "chunk_size": KERNEL_CHUNK}

    def run(x: torch.Tensor) -> torch.Tensor:
        kept = {name: getattr(ours, name) for name in switches}
        for name, value in switches.items():
            setattr(ours, name, value)
        try:
            return ours(x, None, None, attn)
        finally:
            for name, value in kept.items():
                setattr(ours, name, value)

    return run


def timed(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> tuple[float, float]:
    """Seconds per forward + backward of `step` on `x` (after one warm-up), and the peak GiB allocated (GPU)."""

    def once() -> None:
        x.grad = None
        step(x).float().square().mean().backward()

    if x.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    once()
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        once()
    if x.is_cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if x.is_cuda else float("nan")
    return (time.perf_counter() - start) / iters, peak


def packed_resets(tokens: int, documents: int, device: torch.device) -> torch.Tensor:
    starts = torch.zeros(1, tokens, dtype=torch.bool, device=device)
    starts[0, :: tokens // documents] = True
    return starts


def bench(config: dict, args: argparse.Namespace, device: torch.device) -> list[tuple]:
    family = config["model_type"]
    theirs, ours = layers(config, device)
    hidden = config["hidden_size"]
    rows = []
    for i, tokens in enumerate(args.tokens):
        x = (torch.randn(1, tokens, hidden, device=device, generator=None) * 0.5).to(torch.bfloat16)
        x.requires_grad_(True)
        with torch.no_grad():
            want = theirs(x[:, :4096]).float()  # the first 4K tokens: what transformers' path fits at any length
            diff = (ours(x[:, :4096], None, None, AttnInputs()).float() - want).abs().max().item()
            del want
        try:
            hf_s, hf_peak = timed(lambda t: theirs(t), x, args.iters)
        except torch.OutOfMemoryError:  # transformers' torch path materialises more than tandem's
            hf_s = hf_peak = float("nan")
            torch.cuda.empty_cache()
        print(f"  {family} {tokens} transformers: {tokens / hf_s:,.0f} tok/s", flush=True)
        documents = AttnInputs(resets=packed_resets(tokens, 8, device))
        variants = {
            "tandem chunked": lambda t: ours(t, None, None, AttnInputs()),
            "tandem chunked, packed (8 documents)": lambda t, attn=documents: ours(t, None, None, attn),
        }
        if "triton" in SCAN_BACKENDS:
            variants["tandem chunked, Triton kernels"] = with_kernels(ours, AttnInputs())
            variants["tandem chunked, Triton kernels, packed"] = with_kernels(ours, documents)
        if i == 0:
            variants["tandem recurrent reference"] = reference(ours, family)
        hf_note = "out of memory" if hf_s != hf_s else ""
        rows.append((family, tokens, "transformers (torch path)", tokens / hf_s, 1.0, hf_peak, hf_note))
        for label, step in variants.items():
            try:
                seconds, peak = timed(step, x, 1 if "recurrent" in label else args.iters)
            except torch.OutOfMemoryError:  # one variant out of memory must not lose the others' numbers
                rows.append((family, tokens, label, float("nan"), float("nan"), float("nan"), "out of memory"))
                torch.cuda.empty_cache()
                continue
            note = f"max abs diff vs transformers {diff:.1e}" if label == "tandem chunked" else ""
            rows.append((family, tokens, label, tokens / seconds, hf_s / seconds, peak, note))
            print(f"  {family} {tokens} {label}: {tokens / seconds:,.0f} tok/s", flush=True)
        del x
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny layers, short sequences")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # as `speed.*_kernel = triton` register them
        from tandem.kernels.delta_scan import delta_chunk_scan_triton
        from tandem.kernels.ssd import intra_chunk_ssd_triton

        SCAN_BACKENDS["triton"], SSD_BACKENDS["triton"] = delta_chunk_scan_triton, intra_chunk_ssd_triton
    configs = [QWEN3_NEXT_LAYER, NEMOTRON_H_LAYER]
    if args.smoke:
        args.tokens, args.iters = [64, 128], 1
        configs = [{**c, **SMOKE_SIZES[c["model_type"]]} for c in configs]
    rows = [row for config in configs for row in bench(config, args, device)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}: forward + backward of one layer, one sequence")
    print(f"{'layer':<11} {'tokens':>6}  {'variant':<38} {'tok/s':>11} {'vs transformers':>15} {'peak GiB':>8}  note")
    for family, tokens, label, tok_s, ratio, peak, note in rows:
        print(f"{family:<11} {tokens:>6}  {label:<38} {tok_s:>11,.0f} {ratio:>14.2f}x {peak:>8.1f}  {note}")


if __name__ == "__main__":
    main()
