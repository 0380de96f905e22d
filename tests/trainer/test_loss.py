"""The RL losses on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.config.trainer import LossConfig
from tandem.trainer.loss import LossInputs, policy_loss


def inputs(p, q, advantages, weights=None):
    logp = torch.tensor(p, dtype=torch.float64).log().requires_grad_()
    n = len(p)
    return LossInputs(
        logprobs=logp,
        inference_logprobs=torch.tensor(q, dtype=torch.float64).log(),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        weights=torch.tensor(weights or [1.0 / n] * n, dtype=torch.float64),
    )


RARE_UP = (0.06, 0.01)  # r = 6, |p - q| = 0.05
LIKELY_DOWN = (0.20, 0.90)  # r = 0.22, |p - q| = 0.7


def kept(loss_type, p, q, advantage=1.0):
    """A token is kept iff it gets a gradient."""
    x = inputs([p], [q], [advantage], [1.0])
    loss, _ = policy_loss(LossConfig(type=loss_type), x)
    loss.backward()
    return bool(x.logprobs.grad.abs().item() > 0)


def test_rare_token_that_rose_is_kept_by_ipo_and_masked_by_icepop():
    assert kept("ipo", *RARE_UP)
    assert not kept("icepop", *RARE_UP)


def test_likely_token_that_fell_is_masked_by_ipo_and_kept_by_icepop():
    assert not kept("ipo", *LIKELY_DOWN)
    assert kept("icepop", *LIKELY_DOWN)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_ipo_mask_is_double_sided_and_ignores_the_advantage_sign(advantage):
    assert not kept("ipo", 0.95, 0.5, advantage)  # p > q + eps
    assert not kept("ipo", 0.1, 0.5, advantage)  # p < q - eps
    assert kept("ipo", 0.7, 0.5, advantage)
    assert kept("ipo", 0.25, 0.5, advantage)


def test_ipo_objective_value_and_gradient():
    x = inputs([0.5, 0.3, 0.95], [0.4, 0.3, 0.5], [2.0, -1.0, 1.0], [0.5, 0.25, 0.25])
    loss, metrics = policy_loss(LossConfig(), x)
    # kept: tokens 0 and 1 (|p - q| = 0.1 and 0); token 2 masked on the high side
    expected = 0.5 * (-2.0 * 0.5 / 0.4) + 0.25 * (1.0 * 1.0)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d(-A w r)/d log p = -A w r
    assert x.logprobs.grad.tolist() == pytest.approx([-0.5 * 2.0 * 1.25, 0.25 * 1.0, 0.0])
    assert metrics["masked_high"].item() == pytest.approx(0.25)
    assert metrics["masked_low"].item() == 0.0


def test_icepop_bounds_are_configurable():
    config = LossConfig(type="icepop", icepop_low=0.5, icepop_high=2.0)
    x = inputs([0.2, 0.5, 0.9], [0.5, 0.5, 0.3], [1.0, 1.0, 1.0], [1 / 3] * 3)
    _, metrics = policy_loss(config, x)  # r = 0.4 (low), 1 (kept), 3 (high)
    assert metrics["masked_low"].item() == pytest.approx(1 / 3)
    assert metrics["masked_high"].item() == pytest.approx(1 / 3)


def test_ppo_clipped_surrogate():
    # r = 1.5 with A > 0 clips to 1.2; r = 0.5 with A > 0 is not clipped (min picks r·A)
    x = inputs([0.6, 0.2], [0.4, 0.4], [1.0, 1.0], [0.5, 0.5])
    loss, metrics = policy_loss(LossConfig(type="ppo"), x)
    assert loss.item() == pytest.approx(0.5 * -1.2 + 0.5 * -0.5)
    loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([0.0, -0.5 * 0.5])  # the clipped token has no gradient
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)  # both ratios lie outside [0.8, 1.2]
    # A < 0 and r = 0.5: min(-0.5, -0.8) = -0.8 → clipped, no gradient
    y = inputs([0.2], [0.4], [-1.0], [1.0])
    loss, _ = policy_loss(LossConfig(type="ppo"), y)
    assert loss.item() == pytest.approx(0.8)
    loss.backward()
    assert y.logprobs.grad.item() == 0.0


def test_cispo_detached_clipped_weight_times_log_p():
    x = inputs([0.6, 0.2], [0.3, 0.4], [1.0, -2.0], [0.5, 0.5])  # r = 2 (clipped to 1.28), r = 0.5
    loss, metrics = policy_loss(LossConfig(type="cispo"), x)
    expected = 0.5 * (-1.28 * 1.0 * math.log(0.6)) + 0.5 * (-0.5 * -2.0 * math.log(0.2))
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # gradient through log p only: -w·A·weight
    assert x.logprobs.grad.tolist() == pytest.approx([-0.5 * 1.28, 0.5 * 0.5 * 2.0])
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)


def test_mismatch_kl_is_the_k3_estimator_and_kl_penalty_is_off_by_default():
    p, q = [0.5, 0.3], [0.4, 0.6]
    x = inputs(p, q, [0.0, 0.0], [0.5, 0.5])
    loss, metrics = policy_loss(LossConfig(), x)
    k3 = [pi / qi - 1 - math.log(pi / qi) for pi, qi in zip(p, q, strict=True)]
    assert metrics["mismatch_kl"].item() == pytest.approx(0.5 * sum(k3))
    assert loss.item() == 0.0  # zero advantages and no KL term
    penalised, _ = policy_loss(LossConfig(kl_coef=0.1), inputs(p, q, [0.0, 0.0], [0.5, 0.5]))
    assert penalised.item() == pytest.approx(0.1 * 0.5 * sum(k3))


def test_identical_policies_have_zero_mismatch_and_unit_ratio():
    x = inputs([0.3, 0.7], [0.3, 0.7], [1.0, -1.0], [0.5, 0.5])
    _, metrics = policy_loss(LossConfig(), x)
    assert metrics["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-12)
    assert metrics["ratio"].item() == pytest.approx(1.0)
    assert metrics["masked_low"].item() == metrics["masked_high"].item() == 0.0
