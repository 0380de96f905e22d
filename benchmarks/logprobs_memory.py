"""Peak memory and time of chunked vs naive per-token logprobs + entropy (forward, and forward + backward) on CPU.

Baseline: `reference_token_logprobs` (full `[tokens, vocab]` fp32 logits, autograd through log_softmax).
Memory: each variant runs in a fresh subprocess; we report the growth of peak RSS (`getrusage` ru_maxrss, which
sees every tensor the CPU allocator maps) above the RSS after the inputs were allocated. Inputs (hidden states,
LM head) and, for fwd+bwd, their gradients are the same for both variants and the weight gradient is included.

    python benchmarks/logprobs_memory.py [--tokens 4096] [--vocab 151936] [--hidden 256] [--chunk-size 512]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("naive", "chunked")
MODES = ("forward", "forward+backward")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _worker(args: argparse.Namespace) -> None:
    import torch

    from tandem.models import reference_token_logprobs, token_logprobs

    torch.manual_seed(0)
    grad = args.mode == "forward+backward"
    hidden = torch.randn(args.tokens, args.hidden).requires_grad_(grad)
    weight = (torch.randn(args.vocab, args.hidden) * 0.05).requires_grad_(grad)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    baseline = _rss_bytes()

    def run() -> None:
        with torch.set_grad_enabled(grad):
            if args.variant == "naive":
                out = reference_token_logprobs(hidden, weight, targets, temperature=0.9)
            else:
                out = token_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=args.chunk_size)
            if grad:
                (out.logprobs.sum() + out.entropy.sum()).backward()
                hidden.grad = weight.grad = None

    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_bytes": _peak_rss_bytes() - baseline, "seconds": seconds}))


def _measure(args: argparse.Namespace, variant: str, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--mode", mode]
    for key in ("tokens", "vocab", "hidden", "chunk_size"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    mib = 2**20
    chunk_logits = args.chunk_size * args.vocab * 4
    print(f"tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} chunk_size={args.chunk_size} fp32, CPU")
    print("peak memory = growth of peak RSS (getrusage ru_maxrss) over the inputs, one fresh process per variant")
    print(
        f"full logits: {args.tokens * args.vocab * 4 / mib:,.0f} MiB; one chunk of logits: {chunk_logits / mib:,.0f} MiB;"
    )
    print(f"LM-head weight gradient (fwd+bwd, both variants): {args.vocab * args.hidden * 4 / mib:,.0f} MiB")
    print()
    header = f"{'mode':<18}{'variant':<9}{'peak MiB':>10}{'chunks':>8}{'time s':>9}{'naive/chunked mem':>19}{'time':>7}"
    print(header)
    print("-" * len(header))
    for mode in MODES:
        results = {variant: _measure(args, variant, mode) for variant in VARIANTS}
        for variant, r in results.items():
            ratio_mem = results["naive"]["peak_bytes"] / max(results["chunked"]["peak_bytes"], 1)
            ratio_time = results["naive"]["seconds"] / results["chunked"]["seconds"]
            ratios = f"{ratio_mem:>19.1f}{ratio_time:>7.2f}" if variant == "chunked" else ""
            print(
                f"{mode:<18}{variant:<9}{r['peak_bytes'] / mib:>10,.0f}{r['peak_bytes'] / chunk_logits:>8.1f}"
                f"{r['seconds']:>9.2f}{ratios}"
            )
    print("\n'chunks' = peak / one chunk of fp32 logits.")


if __name__ == "__main__":
    main()
