"""What `CausalLM.forward` returns: a head, applied to the final hidden states and the LM head's weight.

The forward runs the decoder, then returns `head(hidden [B, S, H], weight [V, H])`. It calls the head itself
because under FSDP the LM head (or the tied embedding) is unsharded only inside the forward, so whatever multiplies
by it (full logits, chunked logprobs, a loss whose gradient is formed in the forward) must run there. A head is a
small frozen callable that carries its own inputs (targets, temperatures, kept ids); a new output is a new head,
not a new flag of `forward`. Heads that belong to a caller live with it (RL's fused policy loss:
`tandem.trainer.fused_loss.FusedPolicyLoss`) and follow the same `Head` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from .logprobs import DEFAULT_CHUNK_SIZE, TokenLogprobs, token_logprobs
from .nll_sum import fused_nll_sum

T_co = TypeVar("T_co", covariant=True)


class Head(Protocol[T_co]):
    """`head(hidden, weight)`: the final (normed) hidden states `[B, S, H]` and the LM head `[V, H]` -> the
    forward's result."""

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> T_co: ...


@dataclass(frozen=True)
class Logits:
    """Logits `[B, S, V]` in the model dtype (what Hugging Face's `.logits` holds): the forward's default."""

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return hidden @ weight.T


LOGITS = Logits()
"""The forward's default head (one instance: a frozen head with no fields)."""


@dataclass(frozen=True)
class Hidden:
    """The final hidden states `[B, S, H]`, after the final norm, for a caller that applies the LM head itself."""

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return hidden


@dataclass(frozen=True, eq=False)
class Logprobs:
    """`TokenLogprobs` of `targets` `[B, S]` (IGNORE_INDEX: logprob 0), chunked so full logits are never formed:
    the training path (`logprobs.token_logprobs` says what `temperature` and `kept_matrix` `[B, S, K]` do).
    SFT, which needs no entropy, skips it with `with_entropy=False`."""

    targets: torch.Tensor
    temperature: float | torch.Tensor = 1.0
    kept_matrix: torch.Tensor | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    with_entropy: bool = True

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> TokenLogprobs:
        return token_logprobs(
            hidden,
            weight,
            self.targets,
            temperature=self.temperature,
            kept_matrix=self.kept_matrix,
            chunk_size=self.chunk_size,
            with_entropy=self.with_entropy,
        )


@dataclass(frozen=True, eq=False)
class NllSum:
    """SFT's loss: the summed NLL of `targets` `[B, S]` at temperature 1, a 0-d fp32 tensor whose gradient is
    formed in the same chunked pass (`nll_sum.fused_nll_sum`: backpropagate it once)."""

    targets: torch.Tensor
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fused_nll_sum(hidden, weight, self.targets, chunk_size=self.chunk_size)
