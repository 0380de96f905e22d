"""`tandem rl` with `inference.engine = "vllm"`: the same orchestrator, trainer and weight updates, with the real
vLLM serving the rollouts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from support.jsonl import read_jsonl, read_metrics
from support.runs import tandem_rl, write_rl_sources
from support.tiny_models import INIT_STD
from tandem.models import Logprobs, load_model
from tandem.transport.batches import read_batch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason='vLLM is not installed: pip install -e ".[vllm]"'
    ),
]

STEPS = 3


def mismatch_kl(policy: Path, batch: list[dict]) -> float:
    """k3 mismatch KL between the logprobs the server reported for a batch and `policy`'s recomputation."""
    model = load_model(policy, dtype=torch.float32, device=torch.device("cpu"))
    log_ratios = []
    for micro in batch:
        with torch.no_grad():
            head = Logprobs(micro["target_ids"], temperature=micro["temperatures"], with_entropy=False)
            out = model(micro["input_ids"], micro["position_ids"], head=head)
        on_loss = micro["target_ids"] != -100
        log_ratios.append((out.logprobs - micro["inference_logprobs"])[on_loss].double())
    log_ratio = torch.cat(log_ratios)
    return (log_ratio.exp() - 1 - log_ratio).mean().item()


def test_tandem_rl_trains_against_vllm_and_serves_each_new_policy(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen3", head_dim=64, initializer_range=INIT_STD)
    # the online evals go through vLLM's own chat route
    tandem_rl(
        model, tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", str(STEPS), "--inference.engine", "vllm",
        "--inference.device", "cpu", "--orchestrator.async-level", "0", "--orchestrator.no-filter-zero-advantage",
        "--orchestrator.keep-batches", "--trainer.ckpt.hf-interval", "1",
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    trainer, stream = read_metrics(run_dir), read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    rollouts = [r for r in stream if r.get("kind") != "eval"]
    evals = [r for r in stream if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [2]
    assert evals[0]["eval/arithmetic/ok"] + evals[0]["eval/arithmetic/truncated"] == 3, evals
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == list(range(1, STEPS + 1))
    # async_level 0: batch N is sampled by policy N-1, the weights the trainer holds at step N
    assert [r["policy_version"] for r in rollouts] == list(range(STEPS))
    assert all(r["staleness"] == {"1": 16} for r in rollouts)
    assert all(r["mismatch_kl"] is not None and abs(r["mismatch_kl"]) < 1e-6 for r in trainer), trainer
    # Each update changed what vLLM samples from: batch N's logprobs are policy N-1's, far from policy N-2's.
    policies = [model] + [run_dir / "hf" / f"step-{step:06d}" for step in range(1, STEPS)]  # pruning keeps these
    for step in range(2, STEPS + 1):
        batch, _ = read_batch(run_dir / "batches", step, 0, 1)
        served, previous = mismatch_kl(policies[step - 1], batch), mismatch_kl(policies[step - 2], batch)
        print(f"\nbatch {step}: KL to policy {step - 1} (served) {served:.3g}, to policy {step - 2} {previous:.3g}")
        assert served < 1e-6 and previous > 100 * max(served, 1e-9)
