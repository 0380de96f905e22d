"""`tandem rl` on a tiny random DeepSeek-V3 (MLA, group-limited sigmoid routing with a correction bias, a shared
expert): the engine samples it, the trainer trains it, policies flow back, and the router stays as it was."""

from __future__ import annotations

import pytest
import torch

from support.model_parity import DEEPSEEK_V3, write_servable_model
from support.runs import two_on_policy_rl_steps

ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shared", "file"])
def test_two_rl_steps_train_deepseek_v3_with_the_router_frozen(transport, tmp_path):
    """Over the in-memory hand-off `tandem rl` picks on one machine (trainer names to engine names), and the
    directory one vLLM takes (the Hugging Face export read back)."""
    model_dir = write_servable_model(tmp_path / "model", DEEPSEEK_V3)
    before, after = two_on_policy_rl_steps(model_dir, tmp_path, "--trainer.weights.transport", transport)
    assert sorted(after) == sorted(before)
    routers = [name for name in before if name.endswith(ROUTER)]
    assert len(routers) == 2 * (DEEPSEEK_V3["num_hidden_layers"] - DEEPSEEK_V3["first_k_dense_replace"])
    for name in routers:  # freeze_router is on by default in RL; the correction bias never trains
        assert torch.equal(after[name], before[name]), name
    for part in ("self_attn.kv_b_proj", "self_attn.q_a_proj", "mlp.shared_experts.down_proj", "mlp.experts.0"):
        assert any(part in name and not torch.equal(after[name], before[name]) for name in before), part
