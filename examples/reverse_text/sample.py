"""Show what the SFT'd reverse-text model answers on held-out prompts, and its reward.

    python examples/reverse_text/sample.py [--model outputs/reverse-text-sft/hf/final] [--rows 8]

Greedy decoding with `transformers` on the exported Hugging Face checkpoint, scored by the
reverse_text environment's own reward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.envs import Task, load_taskset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("outputs/reverse-text-sft/hf/final"))
    parser.add_argument("--test", type=Path, default=Path("outputs/reverse_text/test.jsonl"))
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    env = load_taskset("reverse_text")
    rows = [json.loads(line) for line in args.test.read_text().splitlines()]
    rewards = []
    for index, row in enumerate(rows):
        prompt, answer = row["messages"][:-1], row["messages"][-1]["content"]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=64, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        completion = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        task = Task(idx=index, prompt=prompt, answer=answer)
        rewards.append(asyncio.run(env.score(task, completion)).reward)
        if index < args.rows:
            text = prompt[-1]["content"].rsplit("\n", 1)[-1]
            print(f"{text!r:45} -> {completion!r:45} reward {rewards[-1]:.2f}")
    print(f"mean reward over {len(rows)} held-out prompts: {sum(rewards) / len(rows):.3f}")


if __name__ == "__main__":
    main()
