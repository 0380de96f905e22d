"""The learning curve of an RL run: sampled training reward and held-out greedy reward by step, and wall time.

    python examples/reverse_text/curve.py [outputs/reverse-text-rl] [--png curve.png] [--readme README.md]

Reads the run's `orchestrator_metrics.jsonl`: the training batches' mean reward, and the online evals (`kind =
"eval"`, `eval/<source>/reward`; with `orchestrator.eval.at_start` step 0 is the starting policy). Prints a
Markdown table; `--png` also draws it (needs matplotlib: `pip install matplotlib`); `--readme FILE` rewrites the
table between the `<!-- rl-curve -->` and `<!-- /rl-curve -->` lines of FILE, so the README shows what a run
measured, never numbers typed by hand.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from tandem.jsonl import read_records

START, END = "<!-- rl-curve -->", "<!-- /rl-curve -->"


def read(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, eval records) of the run, in step order."""
    path = run_dir / "orchestrator_metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: run the RL example first (tandem rl @ examples/reverse_text/rl.toml)")
    rows = read_records(path)
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not evals:
        raise SystemExit(f"{path} has no online eval records: set [orchestrator.eval] interval (and at_start)")
    return [r for r in rows if r.get("kind") != "eval"], evals


def table(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> tuple[str, list[tuple[int, float, float]]]:
    """The Markdown table (one row per eval) and its points (step, held-out reward, minutes since the first batch
    began, at the end of the step's batch)."""
    key = next(k for k in evals[0] if k.startswith("eval/") and k.endswith("/reward"))
    start = train[0]["time"] - train[0]["batch_time_s"]  # when the first batch began
    at_step = {r["step"]: r["time"] for r in train}
    by_step = {r["step"]: r["reward"] for r in train}
    lines = [
        f"| step | sampled reward (training batch) | held-out greedy reward ({key.split('/')[1]}) | minutes |",
        "| ---: | ---: | ---: | ---: |",
    ]
    points = []
    for record in evals:
        step, reward = record["step"], record[key]
        minutes = (at_step.get(step, start) - start) / 60
        sampled = f"{by_step[step]:.3f}" if step in by_step else "-"
        lines.append(f"| {step} | {sampled} | {reward:.3f} | {minutes:.1f} |")
        points.append((step, reward, minutes))
    first, last = points[0], points[-1]
    lines.append("")
    lines.append(
        f"Held-out greedy reward {first[1]:.3f} -> {last[1]:.3f} ({last[1] - first[1]:+.3f}) in {last[0] - first[0]} "
        f"steps, {last[2] - first[2]:.1f} minutes from the first batch (processes' start-up not counted)."
    )
    return "\n".join(lines), points


def plot(train: list[dict[str, Any]], points: list[tuple[int, float, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install matplotlib") from None
    figure, axes = plt.subplots(figsize=(6, 3.2), dpi=100)
    axes.plot([r["step"] for r in train], [r["reward"] for r in train], lw=0.8, alpha=0.6, label="sampled (training)")
    axes.plot([p[0] for p in points], [p[1] for p in points], "o-", lw=1.8, label="held-out, greedy")
    axes.set_xlabel("RL step")
    axes.set_ylabel("reward")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    print(f"wrote {path}")


def update_readme(path: Path, text: str) -> None:
    content = path.read_text()
    pattern = re.compile(rf"{re.escape(START)}\n.*?{re.escape(END)}", re.S)
    if not pattern.search(content):
        raise SystemExit(f"{path} has no {START} ... {END} block to rewrite")
    path.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", content))
    print(f"rewrote the curve in {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", type=Path, default=Path("outputs/reverse-text-rl"))
    parser.add_argument("--png", type=Path, help="also draw the curve into this PNG (needs matplotlib)")
    parser.add_argument("--readme", type=Path, help="rewrite the table between the rl-curve markers of this file")
    args = parser.parse_args()
    train, evals = read(args.run_dir)
    text, points = table(train, evals)
    print(text)
    if args.png:
        plot(train, points, args.png)
    if args.readme:
        update_readme(args.readme, text)


if __name__ == "__main__":
    main()
