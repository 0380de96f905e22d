"""GRPO advantages per group of rollouts of one task, and the per-token loss weights of a batch.

The weights make the loss aggregation exact however the trainer splits the batch: the trainer
computes Σ_t w_t · o_t over its tokens and the ranks' sums add up to the batch loss.
- token mean: w_t = 1 / (loss tokens in the batch);
- prompt mean: w_t = 1 / (prompts in the batch × loss tokens of that prompt's rollouts), so
  every prompt weighs the same whatever its rollouts' lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Baseline = Literal["mean", "length_weighted"]
Aggregation = Literal["token_mean", "prompt_mean"]


def group_advantages(
    rewards: Sequence[float],
    lengths: Sequence[int],
    baseline: Baseline = "mean",
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    """A_i = reward_i − baseline over one group; optionally divided by the group's reward std.

    The length-weighted baseline is Σ len·reward / Σ len: with token-level losses, long rollouts
    contribute more tokens, and this baseline makes the token-weighted advantages sum to zero.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    if baseline == "length_weighted":
        n = torch.tensor(lengths, dtype=torch.float64)
        base = (n * r).sum() / n.sum().clamp_min(1)
    else:
        base = r.mean()
    advantages = r - base
    if normalize_std:
        advantages = advantages / (r.std(unbiased=False) + eps)
    return advantages.tolist()


def loss_weights(
    loss_tokens: Sequence[int], prompt_of: Sequence[int], aggregation: Aggregation = "token_mean"
) -> list[float]:
    """The per-token weight of each sample's loss tokens (samples in batch order)."""
    if aggregation == "token_mean":
        total = sum(loss_tokens)
        return [1.0 / total if total else 0.0 for _ in loss_tokens]
    per_prompt: dict[int, int] = {}
    for tokens, prompt in zip(loss_tokens, prompt_of, strict=True):
        per_prompt[prompt] = per_prompt.get(prompt, 0) + tokens
    num_prompts = len(per_prompt)
    return [1.0 / (num_prompts * per_prompt[p]) if per_prompt[p] else 0.0 for p in prompt_of]
