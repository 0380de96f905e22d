"""GRPO advantages and loss weights."""

from __future__ import annotations

import pytest

from tandem.orchestrator.advantages import group_advantages, loss_weights


def test_mean_baseline():
    assert group_advantages([1.0, 0.0, 0.5, 0.5], [3, 3, 3, 3]) == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_std_normalisation():
    advantages = group_advantages([1.0, 0.0], [1, 1], normalize_std=True)
    assert advantages == pytest.approx([1.0, -1.0], rel=1e-5)
    assert group_advantages([0.3, 0.3], [1, 5], normalize_std=True) == [0.0, 0.0]  # no NaN on a flat group


def test_length_weighted_baseline_makes_token_weighted_advantages_sum_to_zero():
    rewards, lengths = [1.0, 0.0, 0.0], [10, 2, 8]
    advantages = group_advantages(rewards, lengths, baseline="length_weighted")
    baseline = (10 * 1.0) / 20
    assert advantages == pytest.approx([1 - baseline, -baseline, -baseline])
    assert sum(a * n for a, n in zip(advantages, lengths, strict=True)) == pytest.approx(0.0)


def test_loss_weights_token_and_prompt_mean():
    tokens, prompts = [2, 6, 4], [0, 0, 1]
    assert loss_weights(tokens, prompts, "token_mean") == pytest.approx([1 / 12] * 3)
    # prompt 0 has 8 loss tokens, prompt 1 has 4: each prompt's tokens share 1/2
    assert loss_weights(tokens, prompts, "prompt_mean") == pytest.approx([1 / 16, 1 / 16, 1 / 8])
