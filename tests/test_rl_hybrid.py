"""`tandem rl` on a tiny random Qwen3-Next (Gated DeltaNet layers with a recurrent state beside gated attention): the
engine samples it with a state slot per sequence, the trainer trains it, policies flow back, and the logprobs of
both sides agree."""

from __future__ import annotations

import pytest
import torch

from support.hybrid_models import write_servable_hybrid
from support.runs import two_on_policy_rl_steps


@pytest.mark.slow
def test_two_rl_steps_train_qwen3_next(tmp_path):
    model_dir = write_servable_hybrid(tmp_path / "model")
    before, after = two_on_policy_rl_steps(model_dir, tmp_path)
    assert sorted(after) == sorted(before)
    for part in ("linear_attn.in_proj_qkvz", "linear_attn.out_proj", "self_attn.q_proj"):
        assert any(part in name and not torch.equal(after[name], before[name]) for name in before), part
