"""The policy-loss study: IPO at three eps against IcePop, PPO and CISPO, under growing policy lag and an injected
trainer/inference mismatch, on a reward that moves within a few steps.

    python benchmarks/ipo_study.py --smoke                      # CPU, two tiny runs: does everything run?
    python benchmarks/ipo_study.py --out-dir docs/ipo           # CPU, the small grid (~17 minutes on 2 cores)
    python benchmarks/ipo_study.py --async-levels 8 --steps 40 --out-dir docs/ipo/async8-40   # lag 8, longer
    python benchmarks/ipo_study.py --replot docs/ipo/gpu/results.json   # plots + table of a grid run elsewhere

Every run is the real `tandem rl` (three processes): a tiny random Qwen3-shaped model (`tandem.testing.tiny`),
the `tandem.testing.toy_envs:LetterE` reward (the fraction of 'e' in the reply, which such a model raises from
~0.1 in tens of steps), 16 prompts x group 4 a step, a learning rate high enough (3e-2 at width 64, scaled by
64 / `--hidden` for wider models) that the loss's off-policy correction matters. The grid: `--losses` x `--async-levels` x `--mismatch` (`none`: trainer and
inference both fp32, ~1e-9 KL; `bf16`: inference in bfloat16 against the fp32 trainer). Per run it records, per
step, the batch reward, the masked fraction on each side, the KL at lag 0 (`mismatch_kl`) and over all tokens
(`off_policy_kl`), and says whether the run collapsed (diverged, or ended with less than a quarter of the
reward it had gained at its peak). A table comes last; `--out-dir` also gets `results.json` and the plots
(`reward.png`, `masked.png`, `kl.png`; matplotlib). docs/ipo.md reads the results.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the tandem the runs use

from tandem.jsonl import read_records  # noqa: E402
from tandem.testing.progress import run_while_progressing  # noqa: E402
from tandem.testing.tiny import write_tiny_model  # noqa: E402

LOSSES = {
    "ipo-0.1": {"type": "ipo", "ipo_eps": 0.1},
    "ipo-0.2": {"type": "ipo", "ipo_eps": 0.2},
    "ipo-0.3": {"type": "ipo", "ipo_eps": 0.3},
    "icepop": {"type": "icepop"},
    "ppo": {"type": "ppo"},
    "cispo": {"type": "cispo"},
}
MISMATCH = {"none": "float32", "bf16": "bfloat16"}
SOURCE = '[[orchestrator.source]]\nid = "tandem.testing.toy_envs:LetterE"\nsampling = { max_tokens = 16 }\n'


@dataclass
class Run:
    loss: str
    async_level: int
    mismatch: str

    @property
    def name(self) -> str:
        return f"{self.loss}-async{self.async_level}-{self.mismatch}"


@dataclass
class Result:
    run: Run
    steps: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    masked_low: list[float] = field(default_factory=list)
    masked_high: list[float] = field(default_factory=list)
    mismatch_kl: list[float | None] = field(default_factory=list)
    off_policy_kl: list[float] = field(default_factory=list)
    error: str = ""
    no_signal: bool = False
    """Stopped by the orchestrator's NoLearningSignal: every group sampled one answer (entropy ~0)."""
    seconds: float = 0.0

    @property
    def first(self) -> float:
        return sum(self.reward[:3]) / max(1, len(self.reward[:3]))

    @property
    def final(self) -> float:
        return sum(self.reward[-3:]) / max(1, len(self.reward[-3:]))

    @property
    def peak(self) -> float:
        window = [sum(self.reward[i : i + 3]) / 3 for i in range(max(1, len(self.reward) - 2))]
        return max(window, default=self.first)

    @property
    def collapsed(self) -> bool:
        """Diverged, collapsed to one answer (the orchestrator's NoLearningSignal error), or lost three quarters of what
        it had gained by its best 3-step window."""
        if self.error:
            return self.no_signal or "diverged" in self.error or "NaN" in self.error
        gain = self.peak - self.first
        return gain > 0.05 and self.final < self.first + 0.25 * gain


def records(path: Path) -> list[dict[str, Any]]:
    return list(read_records(path)) if path.is_file() else []


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def run_one(run: Run, args: argparse.Namespace, model_dir: Path, work: Path) -> Result:
    result = Result(run)
    sources = work / "sources.toml"
    sources.write_text(SOURCE)
    loss = [part for key, value in LOSSES[run.loss].items() for part in (f"--trainer.loss.{key}", str(value))]
    command = [
        sys.executable, "-m", "tandem", "rl", "@", str(sources), "--model.name", str(model_dir),
        "--model.dtype", "float32", "--inference.model.dtype", MISMATCH[run.mismatch], "--seq-len", "256",
        "--output-dir", str(work), "--run-name", run.name, "--max-steps", str(args.steps),
        "--orchestrator.batch-size", "16", "--orchestrator.group-size", "4", "--orchestrator.async-level",
        str(run.async_level), "--orchestrator.max-off-policy-steps", str(run.async_level + 1),
        "--trainer.optim.lr", str(args.lr), "--orchestrator.log-samples", "0", *loss,
    ]  # fmt: skip
    began = time.monotonic()
    done = run_while_progressing(command, watch=[work / run.name], cwd=ROOT)  # bounded by progress, not a clock
    result.seconds = time.monotonic() - began
    if done.returncode:
        result.error = f"exit {done.returncode}: " + " | ".join(done.stderr.strip().splitlines()[-3:])[-400:]
    run_dir = work / run.name
    if done.returncode:
        logs = [path.read_text(errors="replace") for path in (run_dir / "logs").glob("*.log")]
        result.no_signal = any("collapsed to one answer" in log for log in logs)
    rewards = {
        r["step"]: r["reward"] for r in records(run_dir / "orchestrator_metrics.jsonl") if r.get("kind") != "eval"
    }
    for record in records(run_dir / "metrics.jsonl"):
        step = record["step"]
        result.steps.append(step)
        result.reward.append(rewards.get(step, float("nan")))
        result.masked_low.append(record.get("masked_low") or 0.0)
        result.masked_high.append(record.get("masked_high") or 0.0)
        result.mismatch_kl.append(record.get("mismatch_kl"))
        result.off_policy_kl.append(record.get("off_policy_kl") or 0.0)
    return result


def table(results: list[Result]) -> str:
    header = ["run", "reward first", "peak", "final", "masked low", "masked high", "mismatch KL", "off-policy KL",
              "collapsed", "s"]  # fmt: skip
    rows = []
    for r in results:
        kl0, kl = mean(r.mismatch_kl), mean(r.off_policy_kl)
        rows.append([
            r.run.name, f"{r.first:.3f}", f"{r.peak:.3f}", f"{r.final:.3f}", f"{100 * (mean(r.masked_low) or 0):.2f}%",
            f"{100 * (mean(r.masked_high) or 0):.2f}%", "-" if kl0 is None else f"{kl0:.1e}",
            "-" if kl is None else f"{kl:.1e}", "yes" if r.collapsed else "no", f"{r.seconds:.0f}",
        ])  # fmt: skip
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in [header, *rows]]  # fmt: skip
    failed = [f"{r.run.name}: {r.error}" for r in results if r.error]
    return "\n".join(lines + failed)


def plot(results: list[Result], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    panels = sorted({(r.run.async_level, r.run.mismatch) for r in results})
    for name, series, ylabel, log in [
        ("reward", lambda r: r.reward, "batch reward", False),
        ("masked", lambda r: [lo + hi for lo, hi in zip(r.masked_low, r.masked_high, strict=True)], "masked", False),
        ("kl", lambda r: r.off_policy_kl, "off-policy KL (k3)", True),
    ]:
        figure, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3), dpi=90, sharey=True, squeeze=False)
        for axis, (async_level, mismatch) in zip(axes[0], panels, strict=True):
            for r in results:
                if (r.run.async_level, r.run.mismatch) == (async_level, mismatch) and r.steps:
                    axis.plot(r.steps, series(r), lw=1.2, label=r.run.loss)
            axis.set_title(f"async {async_level}, inference {MISMATCH[mismatch]}", fontsize=9)
            axis.set_xlabel("step")
            axis.grid(alpha=0.3)
            if log:
                axis.set_yscale("log")
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out_dir / f"{name}.png")
        plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="two runs of 3 steps (CI): does every part run?")
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    parser.add_argument("--async-levels", nargs="+", type=int, default=[0, 2, 8])
    parser.add_argument("--mismatch", nargs="+", choices=list(MISMATCH), default=list(MISMATCH))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--lr",
        type=float,
        help="learning rate (default: 3e-2 x 64 / hidden: 3e-2 at the CPU grid's width; at 512 x 8, 3e-2 collapses "
        "the policy to one reply within five steps, docs/ipo.md)",
    )
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size (GPU: a larger model)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, help="write results.json and the plots here")
    parser.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="RESULTS_JSON",
        help="only redraw the plots and table of a grid run elsewhere (into --out-dir)",
    )
    args = parser.parse_args()
    if args.lr is None:
        args.lr = 3e-2 * 64 / args.hidden
    if args.replot:
        results = [Result(**{**r, "run": Run(**r["run"])}) for r in json.loads(args.replot.read_text())]
        plot(results, args.out_dir or args.replot.parent)
        print(table(results))
        return
    if args.smoke:
        args.losses, args.async_levels, args.mismatch, args.steps = ["ipo-0.3", "icepop"], [1], ["bf16"], 3
    runs = [
        Run(loss, level, mismatch) for mismatch in args.mismatch for level in args.async_levels for loss in args.losses
    ]
    with tempfile.TemporaryDirectory(prefix="ipo-study-") as tmp:
        work = args.work_dir or Path(tmp)
        heads = max(4, args.hidden // 64)
        shape = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers,
                 "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": args.hidden // heads}  # fmt: skip
        model_dir = write_tiny_model(work / "model", **shape)
        results = []
        for index, run in enumerate(runs, 1):
            result = run_one(run, args, model_dir, work)
            results.append(result)
            status = "FAILED " + result.error if result.error else f"reward {result.first:.3f} -> {result.final:.3f}"
            print(f"[{index}/{len(runs)}] {run.name}: {status} ({result.seconds:.0f} s)", flush=True)
            if args.out_dir:  # after every run: a grid stopped part-way keeps what it measured
                args.out_dir.mkdir(parents=True, exist_ok=True)
                (args.out_dir / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.out_dir:
        plot(results, args.out_dir)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
