"""RL's policy loss fused with the LM head: logits, logprobs, loss and both gradients in one chunked pass.

The policy loss is a per-token weighted sum Σ_t w_t·o_t(log p_t) (`trainer.loss`), so the gradient with respect
to a chunk's logits is known within that chunk's pass: per chunk, the tempered fp32 logits (matmul in the model
dtype, as `token_logprobs`), restricted to the token's kept ids, give log p of the targets, the log-sum-exp and
the entropy; `policy_loss` itself, run on the chunk's tokens with log p as a small leaf tensor, gives the
chunk's loss, metrics and g_t = d loss / d log p_t (one implementation of every loss, shared with the
reference path); and the logits are overwritten with their gradient g_t·(onehot − p)/T_t, then fed straight
to the two gradient GEMMs (`models.fused_head`). Entropy is only a metric, so it takes no gradient.
`FusedPolicyLoss` is a `models.heads.Head`: the model's forward calls it, where FSDP has the LM head unsharded.

Compared with `token_logprobs` followed by `policy_loss`, the LM head costs three GEMMs instead of four
(nothing is recomputed in the backward), all in the model dtype with fp32 accumulation. Memory: one chunk of
logits at a time (on CUDA the per-chunk softmax, entropy and gradient are compiled kernels that write the
gradient over the logits in place; eager, fp32 temporaries of a chunk's size remain), plus the `[V, H]` fp32
weight gradient and the `[T, H]` hidden gradient, held from the forward to the backward.

No host syncs (no `.item()`, boolean indexing or `nonzero`): tokens off the loss (target -100) stay in place
and are made inert (logprob 0, weight 0, temperature 1, inference logprob and advantage 0), which gives the
reference's result, where they are dropped by indexing. Metrics are weighted sums over chunks, exactly those
of `policy_loss` over the loss tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.config.trainer import LossConfig
from tandem.models.fused_head import fused_head_loss
from tandem.models.logprobs import IGNORE_INDEX, LOGP_FLOOR, kept_mask
from tandem.trainer.loss import LossInputs, policy_loss


@dataclass
class PolicyTokens:
    """Flat per-token tensors `[T]` of one micro-batch, aligned with its flattened hidden states `[T, H]`."""

    targets: torch.Tensor  # int64, IGNORE_INDEX (-100) off the loss
    temperatures: torch.Tensor  # fp32, the sampling temperature of each token
    kept_matrix: torch.Tensor | None  # [T, K] int64 kept ids, padded with -1 (all -1: the whole vocab)
    inference_logprobs: torch.Tensor  # fp32 log q
    advantages: torch.Tensor  # fp32
    weights: torch.Tensor  # fp32, 0 off the loss


def _tempered_over_kept(logits: torch.Tensor, temperature: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits `[rows, V]` divided by each row's temperature, -inf outside the kept ids (as in `token_logprobs`,
    but never in place: the logits are overwritten with their gradient afterwards)."""
    z = logits.float() / temperature[:, None]
    return z if kept is None else z.masked_fill(~kept, float("-inf"))


def _scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    kept: torch.Tensor | None,
    targets: torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(targets' logprobs, log-sum-exp, entropy or None), each `[rows]` fp32; a target outside its kept ids
    gets -inf, as in `token_logprobs`."""
    z = _tempered_over_kept(logits, temperature, kept)
    lse = z.logsumexp(dim=-1)
    picked = z.gather(1, targets[:, None]).squeeze(1) - lse
    entropy = None
    if with_entropy:
        logp = (z - lse[:, None]).clamp_min(LOGP_FLOOR)  # p·log p is 0, not NaN, where p is 0
        entropy = -(logp.exp() * logp).sum(dim=-1)
    return picked, lse, entropy


def _logit_grad_(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    kept: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
) -> None:
    """Overwrite `logits` with d loss / d logits = g·(onehot(target) − p) / T, g = d loss / d log p per row.

    As in `token_logprobs`' backward, a target outside its kept ids (p = 0 there) still gets g / T."""
    p = (_tempered_over_kept(logits, temperature, kept) - lse[:, None]).exp()
    is_target = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    logits.copy_((is_target.float() - p) * (grad_logprobs / temperature)[:, None])


@functools.cache
def _compiled():
    return torch.compile(_scores, dynamic=False), torch.compile(_logit_grad_, dynamic=False)


class PolicyLoss(NamedTuple):
    """A micro-batch's policy loss (0-d, differentiable), `policy_loss`'s metrics (weighted sums) and the detached
    per-token trainer logprobs `[T]`, 0 off the loss."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    logprobs: torch.Tensor


@dataclass(frozen=True, eq=False)
class FusedPolicyLoss:
    """The head `policy_loss` of the trainer logprobs of `tokens.targets` under `softmax(hidden @ weight.T / T)`
    over each token's kept ids, with its gradient formed in the same chunked pass.

    Called as `model(input_ids, positions, head=FusedPolicyLoss(...))` (or on hidden states `[..., H]` and a weight
    `[V, H]`, flattened to the tokens' `[T, H]`). The loss is differentiable in hidden and weight and must be
    backpropagated once.
    """

    tokens: PolicyTokens
    config: LossConfig
    chunk_size: int
    with_entropy: bool = True

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> PolicyLoss:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        tokens, config, with_entropy = self.tokens, self.config, self.with_entropy
        valid = tokens.targets != IGNORE_INDEX
        off = ~valid
        targets = tokens.targets.masked_fill(off, 0)
        temperatures = tokens.temperatures.float().masked_fill(off, 1.0)
        inference_logprobs = tokens.inference_logprobs.float().masked_fill(off, 0.0)
        advantages = tokens.advantages.float().masked_fill(off, 0.0)
        weights = tokens.weights.float().masked_fill(off, 0.0)
        logprobs = torch.zeros(targets.shape[0], dtype=torch.float32, device=hidden.device)
        metrics: dict[str, torch.Tensor] = {}
        scores, logit_grad_ = _compiled() if hidden.is_cuda else (_scores, _logit_grad_)

        def chunk_grad(logits: torch.Tensor, s: int, e: int) -> torch.Tensor:
            kept = None if tokens.kept_matrix is None else kept_mask(tokens.kept_matrix[s:e], logits.shape[1])
            picked, lse, entropy = scores(logits, temperatures[s:e], kept, targets[s:e], with_entropy)
            logp = picked.masked_fill(off[s:e], 0.0)
            with torch.enable_grad():
                leaf = logp.requires_grad_()
                chunk = LossInputs(leaf, inference_logprobs[s:e], advantages[s:e], weights[s:e], entropy)
                loss, chunk_metrics = policy_loss(config, chunk)
                (grad_logprobs,) = torch.autograd.grad(loss, leaf)
            logit_grad_(logits, temperatures[s:e], kept, targets[s:e], lse, grad_logprobs.masked_fill(off[s:e], 0.0))
            logprobs[s:e] = logp.detach()
            for name, value in chunk_metrics.items():
                metrics[name] = metrics[name] + value if name in metrics else value
            return loss.detach()

        loss = fused_head_loss(hidden, weight, self.chunk_size, chunk_grad)
        return PolicyLoss(loss, metrics, logprobs)
