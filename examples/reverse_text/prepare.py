"""Prepare the reverse-text example: a tiny model config, a tokenizer and chat data, all made offline.

    python examples/reverse_text/prepare.py [--out outputs/reverse_text]

Writes `model/` (config.json + tokenizer, no weights: `tandem sft` initialises them randomly),
`train.jsonl` and a held-out `test.jsonl` drawn with another seed, and `train_mixed.jsonl`: the same prompts
with mixed answers, most reversing each word in place ("apple river" -> "elppa revir") and a few reversing the
whole text as the reward asks ("revir elppa"). SFT on the mixed rows gives a model that can do the task but
mostly does the other thing, the starting point of the RL example: RL has to find and reinforce the answers
the reward prefers, which it does within minutes (a from-scratch model this small learns a *new* skill from a
sequence-level reward far more slowly than from SFT's per-token targets; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tandem.envs import load_taskset
from tandem.testing import tiny_config, write_tokenizer

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def chat_rows(seed: int, count: int, max_words: int) -> list[dict]:
    tasks = load_taskset("reverse_text", seed=seed, num_tasks=count, max_words=max_words).tasks()
    return [{"messages": [*task.messages(), {"role": "assistant", "content": task.answer}]} for task in tasks]


def mixed_rows(rows: list[dict], whole_fraction: float, seed: int = 0) -> list[dict]:
    """`rows` with each answer replaced, except a `whole_fraction` of them, by its words reversed in place."""
    rng = random.Random(seed)
    mixed = []
    for row in rows:
        *prompt, answer = row["messages"]
        if rng.random() >= whole_fraction:
            words = answer["content"][::-1].split(" ")
            answer = {"role": "assistant", "content": " ".join(word[::-1] for word in words)}
        mixed.append({"messages": [*prompt, answer]})
    return mixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/reverse_text"))
    parser.add_argument("--train-rows", type=int, default=4000)
    parser.add_argument("--test-rows", type=int, default=64)
    parser.add_argument("--max-words", type=int, default=5, help="phrases of 2 to this many words")
    parser.add_argument(
        "--whole-fraction", type=float, default=0.15, help="share of train_mixed.jsonl answers that reverse the whole text"
    )
    args = parser.parse_args()

    train = chat_rows(seed=0, count=args.train_rows, max_words=args.max_words)
    test = chat_rows(seed=1, count=args.test_rows, max_words=args.max_words)
    corpus = tuple(message["content"] for row in train for message in row["messages"])
    vocab_size = write_tokenizer(args.out / "model", vocab_size=512, corpus=corpus)
    config = tiny_config("qwen3", vocab_size=vocab_size, **MODEL)
    (args.out / "model" / "config.json").write_text(json.dumps(config, indent=2))
    mixed = mixed_rows(train, args.whole_fraction)
    for name, rows in (("train", train), ("test", test), ("train_mixed", mixed)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {args.out}/model (vocab {vocab_size}), {len(train)} train (and mixed) and {len(test)} test rows")


if __name__ == "__main__":
    main()
