"""A learning run on one GPU: a model trained from scratch by `tandem sft` on a task family, then `tandem rl` on new
tasks of it, with held-out accuracy before and after RL, step times and tokens.

    python benchmarks/rl_learning.py --smoke                    # CPU, a tiny model, a few steps: does every part run?
    python benchmarks/rl_learning.py --out-dir rl-learning      # GPU (a few minutes); no network needed

The family is the built-in `arithmetic` environment (`a + b`, `a - b`, `a * b`, operands up to `--max-operand`).
A byte-level BPE tokenizer is trained on the SFT rows and a Qwen3-shaped model of `--hidden`/`--layers` is
initialised randomly (no hub, no weights to carry). `tandem sft` trains it for `--sft-steps` on `--sft-rows` rows
(seed 0, every held-out problem left out); `tandem rl` then trains on problems drawn with seed 2 and evaluates
200 held-out ones (seed 1, greedy)
before its first step and every `--eval-interval` steps, on its own inference server. The table last: SFT
time and tokens/s, held-out accuracy at the start of RL and at its end, RL step time, trainer and rollout
tokens/s. `--out-dir` keeps the runs and writes `results.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the tandem the runs use

from tandem.envs import load_taskset  # noqa: E402
from tandem.jsonl import read_records  # noqa: E402
from tandem.testing import tiny_config, write_tokenizer  # noqa: E402
from tandem.testing.progress import run_while_progressing  # noqa: E402


def eval_tasks(args: argparse.Namespace) -> Any:
    """The held-out problems the RL run evaluates (the same arguments as its eval source)."""
    return load_taskset("arithmetic", seed=1, num_tasks=args.eval_tasks, max_operand=args.max_operand)


def prepare(work: Path, args: argparse.Namespace) -> Path:
    """The model directory (config and tokenizer, random init at SFT) and `sft.jsonl`, which leaves out every
    problem of the held-out eval set (small operands repeat problems across seeds)."""
    held_out = {t.prompt for t in eval_tasks(args).tasks()}
    tasks = load_taskset("arithmetic", seed=0, num_tasks=args.sft_rows, max_operand=args.max_operand).tasks()
    rows = [{"messages": [*t.messages(), {"role": "assistant", "content": t.answer}]} for t in tasks if t.prompt not in held_out]
    corpus = tuple(m["content"] for row in rows[:20_000] for m in row["messages"])
    model = work / "model"
    vocab = write_tokenizer(model, vocab_size=1024, corpus=corpus)
    heads = max(1, args.hidden // 64)
    shape = {
        "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": args.hidden // heads,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(tiny_config("qwen3", vocab_size=vocab, **shape), indent=2))
    (work / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model


def run(command: list[str], watch: Path) -> float:
    """Run a `tandem` command to its end (while it makes progress); its wall time."""
    started = time.monotonic()
    result = run_while_progressing([sys.executable, "-m", "tandem", *command], watch=[watch])
    if result.returncode:
        raise SystemExit(f"tandem {command[0]} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.monotonic() - started


def rl_config(work: Path, args: argparse.Namespace) -> Path:
    path = work / "rl-sources.toml"
    path.write_text(
        f'[[orchestrator.source]]\nid = "arithmetic"\nargs = {{ seed = 2, max_operand = {args.max_operand} }}\n'
        "sampling = { temperature = 1.0, max_tokens = 16 }\n"
        f"[orchestrator.eval]\ninterval = {args.eval_interval}\nat_start = true\n"
        '[[orchestrator.eval.source]]\nid = "arithmetic"\nname = "held-out"\n'
        f"args = {{ seed = 1, num_tasks = {args.eval_tasks}, max_operand = {args.max_operand} }}\n"
        "sampling = { temperature = 0.0, max_tokens = 16 }\n"
    )
    return path


def summarise(work: Path, sft_s: float, rl_s: float) -> dict[str, Any]:
    sft = list(read_records(work / "sft" / "metrics.jsonl"))
    trainer = list(read_records(work / "rl" / "metrics.jsonl"))
    stream = list(read_records(work / "rl" / "orchestrator_metrics.jsonl"))
    evals = [r for r in stream if r.get("kind") == "eval"]
    batches = [r for r in stream if r.get("kind") != "eval"]
    walls = [b["time"] - a["time"] for a, b in itertools.pairwise(trainer)]
    return {
        "sft_s": sft_s,
        "sft_tokens_per_s": statistics.median(r["tokens_per_s"] for r in sft[1:] or sft),
        "sft_final_loss": sft[-1]["loss"],
        "held_out": [(e["step"], e["eval/held-out/reward"]) for e in evals],
        "rl_s": rl_s,
        "rl_step_s": statistics.median(walls) if walls else None,
        "rl_trainer_tokens_per_s": statistics.median(r["tokens_per_s"] for r in trainer),
        "rl_rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in batches),
        "rl_train_reward": (batches[0]["reward"], batches[-1]["reward"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny model, a few steps")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-operand", type=int, default=99)
    parser.add_argument("--sft-rows", type=int, default=200_000)
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts per RL step (groups of 8)")
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--out-dir", type=Path, help="keep the runs here and write results.json")
    args = parser.parse_args()
    dtype, smoke_flags = "bfloat16", []
    if args.smoke:
        args.hidden, args.layers, args.sft_rows, args.sft_steps, args.rl_steps, args.rollouts = 64, 2, 2000, 20, 4, 32
        args.eval_interval, args.eval_tasks, dtype = 2, 16, "float32"
        smoke_flags = ["--orchestrator.filter-zero-advantage", "false"]  # an untrained model's groups are all 0
    with tempfile.TemporaryDirectory(prefix="rl-learning-") as tmp:
        work = args.out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = prepare(work, args)
        common = ["--output-dir", str(work), "--model.dtype", dtype, "--seq-len", "512"]
        sft_s = run(["sft", "--model.name", str(model), "--random-init", "--data.path", str(work / "sft.jsonl"),
                     "--run-name", "sft", "--max-steps", str(args.sft_steps), "--batch-size", "16",
                     "--micro-batch-size", "8", "--optim.lr", "1e-3", "--scheduler.type", "cosine",
                     "--scheduler.warmup-steps", str(max(1, args.sft_steps // 20)), *common], work)  # fmt: skip
        rl_s = run(["rl", "@", str(rl_config(work, args)), "--model.name", str(work / "sft" / "hf" / "final"),
                    "--run-name", "rl", "--max-steps", str(args.rl_steps), "--orchestrator.batch-size", str(args.rollouts),
                    "--orchestrator.group-size", "8", "--trainer.optim.lr", str(args.rl_lr), *smoke_flags, *common], work)  # fmt: skip
        result = summarise(work, sft_s, rl_s)
        if args.out_dir:
            (work / "results.json").write_text(json.dumps(result, indent=1))
    (start_step, start), (end_step, end) = result["held_out"][0], result["held_out"][-1]
    print(f"SFT    {args.sft_steps} steps in {result['sft_s']:.0f} s, {result['sft_tokens_per_s']:,.0f} tok/s, "
          f"final loss {result['sft_final_loss']:.3f}")  # fmt: skip
    print(f"RL     {args.rl_steps} steps in {result['rl_s']:.0f} s, step {result['rl_step_s']:.2f} s, trainer "
          f"{result['rl_trainer_tokens_per_s']:,.0f} tok/s, rollouts {result['rl_rollout_tokens_per_s']:,.0f} tok/s")  # fmt: skip
    print(f"held-out greedy accuracy: {start:.3f} at step {start_step} -> {end:.3f} at step {end_step} "
          f"({end - start:+.3f}); every eval: {result['held_out']}")  # fmt: skip


if __name__ == "__main__":
    main()
