"""`tandem rl` on a tiny random DeepSeek-V3 (MLA, group-limited sigmoid routing with a correction bias, a shared
expert): the engine samples it, the trainer trains it, policies flow back, and the router stays as it was."""

from __future__ import annotations

import pytest
import torch

from support.jsonl import read_jsonl, read_metrics
from support.model_parity import DEEPSEEK_V3, disk_tensors, write_servable_model
from support.runs import tandem_rl

ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shared", "file"])
def test_two_rl_steps_train_deepseek_v3_with_the_router_frozen(transport, tmp_path):
    """Over the in-memory hand-off `tandem rl` picks on one machine (trainer names to engine names), and the
    directory one vLLM takes (the Hugging Face export read back)."""
    model_dir = write_servable_model(tmp_path / "model", DEEPSEEK_V3)
    sources = tmp_path / "sources.toml"
    sources.write_text('[[orchestrator.source]]\nid = "reverse_text"\nsampling = { max_tokens = 16 }\n')
    tandem_rl(
        model_dir, tmp_path, "@", str(sources), "--max-steps", "2", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--orchestrator.eval.interval", "0",
        "--trainer.weights.transport", transport,
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    trainer = read_metrics(run_dir)
    rollouts = read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2]
    assert [r["policy_version"] for r in rollouts] == [0, 1]  # step 2 was sampled by the policy of step 1
    # async_level 0: each batch is sampled by the weights the trainer holds, so this is the numerical mismatch
    assert all(r["mismatch_kl"] is not None and abs(r["mismatch_kl"]) < 1e-3 for r in trainer), trainer
    before, after = disk_tensors(model_dir), disk_tensors(run_dir / "policies" / "step-000002")  # the final policy
    assert sorted(after) == sorted(before)
    routers = [name for name in before if name.endswith(ROUTER)]
    assert len(routers) == 2 * (DEEPSEEK_V3["num_hidden_layers"] - DEEPSEEK_V3["first_k_dense_replace"])
    for name in routers:  # freeze_router is on by default in RL; the correction bias never trains
        assert torch.equal(after[name], before[name]), name
    for part in ("self_attn.kv_b_proj", "self_attn.q_a_proj", "mlp.shared_experts.down_proj", "mlp.experts.0"):
        assert any(part in name and not torch.equal(after[name], before[name]) for name in before), part
