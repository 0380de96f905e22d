"""A learning run on one GPU: the README's reverse-text example at a larger size. A model trained from scratch by
`tandem sft` on mixed answers, then `tandem rl` on new phrases, with the held-out greedy reward before and after
RL, step times and tokens.

    python benchmarks/rl_learning.py --smoke                    # CPU, a tiny model, a few steps: does every part run?
    python benchmarks/rl_learning.py --out-dir rl-learning      # GPU (a few minutes); no network needed

The family is the built-in `reverse_text` environment (reverse a phrase of 2 to `--max-words` words; the reward
is the similarity of the reply to the reversed text). `examples/reverse_text/prepare.py` writes the data and a
byte-level BPE tokenizer; the model is Qwen3-shaped, `--hidden` wide and `--layers` deep, initialised randomly
(no hub, no weights to carry). `tandem sft @ sft.toml @ sft_mixed.toml` trains it for `--sft-steps` on answers
that mostly reverse each word in place and sometimes reverse the whole text as the reward asks; `tandem rl @
rl.toml` then trains on phrases drawn with another seed and evaluates 64 held-out ones (greedy) before its first
step and every `--eval-interval` steps, on its own inference server. The SFT data is the example's; what this
measures is whether RL moves a larger model's held-out reward, and how fast its steps are.

The table last: SFT time and tokens/s, the held-out reward at the start of RL and at its end, RL step time,
trainer and rollout tokens/s. `--out-dir` keeps the runs and writes `results.json`.
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

from tandem.jsonl import read_records  # noqa: E402
from tandem.testing import tiny_config  # noqa: E402
from tandem.testing.progress import run_while_progressing  # noqa: E402

EXAMPLE = ROOT / "examples" / "reverse_text"


def run(command: list[str], watch: Path) -> float:
    """Run a command to its end (while it makes progress); its wall time."""
    started = time.monotonic()
    result = run_while_progressing(command, watch=[watch])
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:4])} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.monotonic() - started


def prepare(work: Path, args: argparse.Namespace) -> Path:
    """The example's data and tokenizer, with a model config of `--hidden` x `--layers`; the model directory."""
    data = work / "data"
    run([sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(data), "--train-rows", str(args.train_rows),
         "--max-words", str(args.max_words)], work)  # fmt: skip
    model = data / "model"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    heads = max(2, args.hidden // 64)
    shape = {
        "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": args.hidden // heads,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(tiny_config("qwen3", vocab_size=vocab, **shape), indent=2))
    return model


def summarise(work: Path, sft_s: float, rl_s: float) -> dict[str, Any]:
    sft = list(read_records(work / "reverse-text-sft-mixed" / "metrics.jsonl"))
    trainer = list(read_records(work / "reverse-text-rl" / "metrics.jsonl"))
    stream = list(read_records(work / "reverse-text-rl" / "orchestrator_metrics.jsonl"))
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
        "rl_train_reward": [b["reward"] for b in batches],
        "mismatch_kl": [r.get("mismatch_kl") for r in trainer],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny model, a few steps")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=5, help="phrases of 2 to this many words")
    parser.add_argument("--train-rows", type=int, default=8000)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype of both runs (--smoke: float32)")
    parser.add_argument("--out-dir", type=Path, help="keep the runs here and write results.json")
    args = parser.parse_args()
    rl_flags: list[str] = []
    if args.smoke:
        args.hidden, args.layers, args.max_words, args.train_rows, args.sft_steps = 64, 2, 2, 500, 20
        args.rl_steps, args.eval_interval, args.dtype = 4, 2, "float32"
        rl_flags = ["--orchestrator.batch-size", "32", "--orchestrator.group-size", "8",
                    "--orchestrator.filter-zero-advantage", "false"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rl-learning-") as tmp:
        work = args.out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = prepare(work, args)
        common = ["--output-dir", str(work), "--model.dtype", args.dtype]
        tandem = [sys.executable, "-m", "tandem"]
        sft_s = run([*tandem, "sft", "@", str(EXAMPLE / "sft.toml"), "@", str(EXAMPLE / "sft_mixed.toml"),
                     "--model.name", str(model), "--data.path", str(work / "data" / "train_mixed.jsonl"),
                     "--max-steps", str(args.sft_steps), "--optim.lr", str(args.sft_lr), "--ckpt.hf-interval", "0",
                     *common], work)  # fmt: skip
        print(f"SFT    {args.sft_steps} steps in {sft_s:.0f} s; RL starts", flush=True)  # what a cut-off run keeps
        start = work / "reverse-text-sft-mixed" / "hf" / "final"
        rl_s = run([*tandem, "rl", "@", str(EXAMPLE / "rl.toml"), "--model.name", str(start),
                    "--max-steps", str(args.rl_steps), "--trainer.optim.lr", str(args.rl_lr),
                    "--orchestrator.eval.interval", str(args.eval_interval), *rl_flags, *common], work)  # fmt: skip
        result = summarise(work, sft_s, rl_s)
        if args.out_dir:
            (work / "results.json").write_text(json.dumps(result, indent=1))
    (start_step, first), (end_step, last) = result["held_out"][0], result["held_out"][-1]
    print(f"SFT    {args.sft_steps} steps in {result['sft_s']:.0f} s, {result['sft_tokens_per_s']:,.0f} tok/s, "
          f"final loss {result['sft_final_loss']:.3f}")  # fmt: skip
    print(f"RL     {args.rl_steps} steps in {result['rl_s']:.0f} s, step {result['rl_step_s']:.2f} s, trainer "
          f"{result['rl_trainer_tokens_per_s']:,.0f} tok/s, rollouts {result['rl_rollout_tokens_per_s']:,.0f} tok/s")  # fmt: skip
    print(f"held-out greedy reward: {first:.3f} at step {start_step} -> {last:.3f} at step {end_step} "
          f"({last - first:+.3f}); every eval: {result['held_out']}")  # fmt: skip


if __name__ == "__main__":
    main()
