"""SFT throughput on CPU for a tiny model, with and without packing (baseline: no packing).

    python benchmarks/sft_cpu.py [--steps 30]

Both runs train the same reverse-text chat rows through `tandem sft` (the real code path) and
count real, non-padding tokens per second over the steps after the first (warm-up). Packing must
not be slower per real token.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.jsonl import read_records

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, data: Path, pack: bool, steps: int) -> dict:
    name = "packed" if pack else "padded"
    command = [
        sys.executable, "-m", "tandem", "sft", "@", str(ROOT / "examples" / "reverse_text" / "sft.toml"),
        "--model.name", str(data / "model"), "--data.path", str(data / "train.jsonl"), "--output-dir", str(out),
        "--run-name", name, "--max-steps", str(steps), "--seq-len", "256", "--log.level", "warning",
        "--data.pack" if pack else "--data.no-pack",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    records = read_records(out / name / "metrics.jsonl")[1:]
    tokens = sum(r["tokens"] for r in records)
    seconds = sum(r["step_time_s"] for r in records)
    return {
        "name": name,
        "real_tokens_per_s": tokens / seconds,
        "real_tokens_per_step": statistics.mean(r["tokens"] for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out, data = Path(tmp), Path(tmp) / "data"
        subprocess.run([sys.executable, str(ROOT / "examples/reverse_text/prepare.py"), "--out", str(data)], check=True)
        padded = run(out, data, pack=False, steps=args.steps)
        packed = run(out, data, pack=True, steps=args.steps)
    print(f"\n{'run':8} {'real tok/s':>12} {'real tok/step':>14} {'step time (s)':>14} {'vs padded':>10}")
    for result in (padded, packed):
        ratio = result["real_tokens_per_s"] / padded["real_tokens_per_s"]
        print(
            f"{result['name']:8} {result['real_tokens_per_s']:12,.0f} {result['real_tokens_per_step']:14,.0f}"
            f" {result['step_time_s']:14.3f} {ratio:9.2f}x"
        )


if __name__ == "__main__":
    main()
