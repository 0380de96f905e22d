"""`tandem rl` on a tiny random Qwen3-Next (Gated DeltaNet layers with a recurrent state beside gated attention): the
engine samples it with a state slot per sequence, the trainer trains it, policies flow back, and the logprobs of
both sides agree."""

from __future__ import annotations

import pytest
import torch

from support.hybrid_models import write_servable_hybrid
from support.jsonl import read_jsonl, read_metrics
from support.model_parity import disk_tensors
from support.runs import tandem_rl


@pytest.mark.slow
def test_two_rl_steps_train_qwen3_next(tmp_path):
    model_dir = write_servable_hybrid(tmp_path / "model")
    sources = tmp_path / "sources.toml"
    sources.write_text('[[orchestrator.source]]\nid = "reverse_text"\nsampling = { max_tokens = 16 }\n')
    tandem_rl(
        model_dir, tmp_path, "@", str(sources), "--max-steps", "2", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--orchestrator.eval.interval", "0",
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    trainer = read_metrics(run_dir)
    rollouts = read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2]
    assert [r["policy_version"] for r in rollouts] == [0, 1]  # step 2 was sampled by the policy of step 1
    # async_level 0: each batch is sampled by the weights the trainer holds, so this is the numerical mismatch
    assert all(r["mismatch_kl"] is not None and abs(r["mismatch_kl"]) < 1e-3 for r in trainer), trainer
    before, after = disk_tensors(model_dir), disk_tensors(run_dir / "policies" / "step-000002")
    assert sorted(after) == sorted(before)
    for part in ("linear_attn.in_proj_qkvz", "linear_attn.out_proj", "self_attn.q_proj"):
        assert any(part in name and not torch.equal(after[name], before[name]) for name in before), part
