"""`tandem rl` on a multi-turn environment: every turn is trained, on exactly the ids the engine produced."""

from __future__ import annotations

import pytest
import torch

from support.jsonl import read_jsonl, read_metrics
from support.runs import tandem_rl
from tandem.transport.batches import read_batch

pytestmark = pytest.mark.slow


def test_multi_turn_rl_trains_every_turn_on_the_engines_own_tokens(tiny_model_dir, tmp_path):
    sources = tmp_path / "sources.toml"
    sources.write_text(
        '[[orchestrator.source]]\nid = "guess_number"\nargs = { max_value = 3 }\nsampling = { max_tokens = 6 }\n'
        '[[orchestrator.source]]\nid = "calculator"\nargs = { digits = 2 }\nsampling = { max_tokens = 6 }\n'
    )
    tandem_rl(
        tiny_model_dir("qwen3"), tmp_path, "@", str(sources), "--max-steps", "2", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--orchestrator.keep-batches", "--orchestrator.log-samples", "4",
        "--seq-len", "1024",  # the calculator's prompt lists its tool: ~450 tokens of the tiny tokenizer
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    trainer = read_metrics(run_dir)
    stream = read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in trainer] == [1, 2]
    # A random tiny model rarely names the secret at once: episodes run several turns. It writes no tool calls,
    # but the tool environment's episodes count them (none, no errors) and its prompts show the tool.
    assert all(r["turns"] > 1.2 for r in stream), [r["turns"] for r in stream]
    assert all(r["tool_calls"] == 0.0 and r["tool_errors"] == 0.0 for r in stream if "reward/calculator#1" in r)
    assert any("reward/calculator#1" in r for r in stream) and any("reward/guess_number#0" in r for r in stream)
    # async_level 0: the trainer scores every generated token in the very context it was sampled in.
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in trainer), [r["mismatch_kl"] for r in trainer]
    # The environment's answers sit between the turns as context: inputs, never targets.
    [micro, *_], _ = read_batch(run_dir / "batches", 1, 0, 1)
    inputs, targets = micro["input_ids"], micro["target_ids"]
    context = (targets == -100) & (torch.roll(inputs, -1, dims=1) != 0)
    assert context.sum() > 0 and (micro["loss_weights"][context] == 0).all()
    # What RL generated reads turn by turn: the replies and the environment's answers as messages.
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    games = [r for r in rollouts if r["source"] == "guess_number#0"]
    assert games and all(r["completion"][0]["role"] == "assistant" for r in games)
    assert any([m["role"] for m in r["completion"][:3]] == ["assistant", "user", "assistant"] for r in games)
    calculator = [r for r in rollouts if r["source"] == "calculator#1"]
    assert calculator and all('"name": "calculate"' in r["prompt"] for r in calculator)
