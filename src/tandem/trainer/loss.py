"""RL policy losses over per-token trainer and inference logprobs, one interface for every type.

Notation (docs/rl.md): p = π_θ(y_t), the trainer's probability of the sampled token; q = π_infer(y_t),
the inference server's, both under the same temperature and over the same replayed kept ids;
r = p / q; A the token's advantage. Every loss is a per-token objective `o_t` reduced as
Σ_t w_t · o_t, where the orchestrator computes the weights `w_t` for the whole batch (token mean or
prompt mean), so the result does not depend on how the batch is split into micro-batches and ranks.

- ipo (default): keep a token iff |p − q| ≤ eps (no gradient through the mask), o = −A·r.
- icepop: keep a token iff low ≤ r ≤ high, o = −A·r.
- ppo: o = −min(r·A, clip(r, 1−ε, 1+ε)·A), the inference policy as the old policy.
- cispo: o = −sg(min(r, 1+ε_high))·A·log p over every loss token.
- any of them + kl_coef · k3 (off by default), k3 = r − 1 − log r: with tokens sampled from q, an
  unbiased, non-negative estimate of KL(π_infer ‖ π_θ), also logged as the mismatch KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config.trainer import LossConfig


@dataclass
class LossInputs:
    """Flat per-token tensors `[T]` of one micro-batch; `weights` is 0 off the loss tokens."""

    logprobs: torch.Tensor  # log p, with gradient
    inference_logprobs: torch.Tensor  # log q
    advantages: torch.Tensor
    weights: torch.Tensor
    entropy: torch.Tensor | None = None


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """r − 1 − log r per token: with tokens sampled from q, an unbiased estimate of KL(q ‖ p), never negative."""
    return log_ratio.exp() - 1 - log_ratio


def _unmasked_and_sides(config: LossConfig, p: torch.Tensor, q: torch.Tensor, ratio: torch.Tensor):
    """(unmasked, masked low side, masked high side) as bool tensors: the tokens ipo/icepop train on and those
    they mask on each side; no gradient flows through them."""
    if config.type == "ipo":
        low, high = p < q - config.ipo_eps, p > q + config.ipo_eps
    elif config.type == "icepop":
        low, high = ratio < config.icepop_low, ratio > config.icepop_high
    else:
        low = high = torch.zeros_like(p, dtype=torch.bool)
    return ~(low | high), low, high


def policy_loss(config: LossConfig, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted loss of a micro-batch and its (weighted-sum) metrics, as 0-d tensors.

    Metrics are sums of `weights · value`, so adding them over micro-batches and ranks gives the
    batch mean under the same aggregation as the loss: no host sync here.
    """
    logp, logq, advantages, weights = inputs.logprobs, inputs.inference_logprobs, inputs.advantages, inputs.weights
    log_ratio = logp - logq
    ratio = log_ratio.exp()
    with torch.no_grad():
        p, q, r = logp.exp(), logq.exp(), ratio.detach()
        unmasked, low, high = _unmasked_and_sides(config, p, q, r)
    if config.type in ("ipo", "icepop"):
        objective = -advantages * ratio * unmasked
        clipped = torch.zeros_like(r, dtype=torch.bool)
    elif config.type == "ppo":
        clipped_ratio = ratio.clamp(1 - config.ppo_clip, 1 + config.ppo_clip)
        objective = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
        clipped = (r - clipped_ratio.detach()).abs() > 0
    else:  # cispo
        weight = ratio.detach().clamp(max=1 + config.cispo_eps_high)
        objective = -weight * advantages * logp
        clipped = r > 1 + config.cispo_eps_high
    kl = k3(log_ratio)
    if config.kl_coef:
        objective = objective + config.kl_coef * kl
    loss = (weights * objective).sum()
    with torch.no_grad():
        metrics = {
            "masked_low": (weights * low).sum(),
            "masked_high": (weights * high).sum(),
            "mismatch_kl": (weights * kl.detach()).sum(),
            "ratio": (weights * r).sum(),
            "clip_fraction": (weights * clipped).sum(),
        }
        if inputs.entropy is not None:
            metrics["entropy"] = (weights * inputs.entropy).sum()
    return loss, metrics
