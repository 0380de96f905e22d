"""Prepare the reverse-text example: a tiny model config, a tokenizer and chat data, all made offline.

    python examples/reverse_text/prepare.py [--out outputs/reverse_text]

Writes `model/` (config.json + tokenizer, no weights: `tandem sft` initialises them randomly),
`train.jsonl` and a held-out `test.jsonl` drawn with another seed.
"""

from __future__ import annotations

import argparse
import json
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


def chat_rows(seed: int, count: int) -> list[dict]:
    tasks = load_taskset("reverse_text", seed=seed, num_tasks=count).tasks()
    return [{"messages": [*task.messages(), {"role": "assistant", "content": task.answer}]} for task in tasks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/reverse_text"))
    parser.add_argument("--train-rows", type=int, default=4000)
    parser.add_argument("--test-rows", type=int, default=64)
    args = parser.parse_args()

    train, test = chat_rows(seed=0, count=args.train_rows), chat_rows(seed=1, count=args.test_rows)
    corpus = tuple(message["content"] for row in train for message in row["messages"])
    vocab_size = write_tokenizer(args.out / "model", vocab_size=512, corpus=corpus)
    config = tiny_config("qwen3", vocab_size=vocab_size, **MODEL)
    (args.out / "model" / "config.json").write_text(json.dumps(config, indent=2))
    for name, rows in (("train", train), ("test", test)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {args.out}/model (vocab {vocab_size}), {len(train)} train and {len(test)} test rows")


if __name__ == "__main__":
    main()
