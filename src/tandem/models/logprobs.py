"""Per-token logprobs, entropy and cross-entropy from final hidden states, chunked over tokens.

`[tokens, vocab]` logits are the largest tensor of a training step (4k tokens x 152k vocab in fp32 is 2.5 GB,
and autograd keeps several). Here at most one chunk of logits exists at a time, in forward and in backward:
the custom autograd function saves only the inputs and one log-sum-exp (and entropy) per token, and the backward
recomputes each chunk's logits; its gradient GEMMs run in the model dtype (on CUDA with fp32 accumulation).
Logits are computed like Hugging Face does (matmul in the model dtype, then fp32), divided by the temperature,
optionally restricted to each token's kept ids (the tokens top-k/top-p/min-p sampling could have drawn), and
normalised over what remains.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fused_head import add_product

DEFAULT_CHUNK_SIZE = 1024
IGNORE_INDEX = -100


class TokenLogprobs(NamedTuple):
    logprobs: torch.Tensor  # fp32, shape of targets; 0 where the target is ignore_index
    entropy: torch.Tensor | None  # fp32 entropy of the (tempered, renormalised) distribution, or None


def kept_mask(kept_matrix: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kept mask, bool `[rows, vocab]`, of a kept matrix `[rows, K]` (kept ids padded with -1); a row with no
    ids keeps the whole vocab."""
    padded = kept_matrix.masked_fill(kept_matrix < 0, vocab)
    mask = torch.zeros(kept_matrix.shape[0], vocab + 1, dtype=torch.bool, device=kept_matrix.device)
    mask = mask.scatter_(1, padded, True)[:, :vocab]
    return mask | (kept_matrix < 0).all(dim=1, keepdim=True)


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, kept_matrix: torch.Tensor | None
) -> torch.Tensor:
    """Tempered fp32 logits `[rows, vocab]`, -inf outside the kept ids; a fresh tensor, modified in place below."""
    z = (hidden @ weight.T).float()
    z = z.div_(temperature[:, None])
    if kept_matrix is not None:
        z = z.masked_fill_(~kept_mask(kept_matrix, weight.shape[0]), float("-inf"))
    return z


def _dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`(a * b).sum(-1)` for `[rows, vocab]` without a third `[rows, vocab]` temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


LOGP_FLOOR = -1e4
"""Where log p is clamped before `p * log p`: entries whose probability is exactly 0 in fp32 (log p below about
-104, and -inf outside the kept ids) then give 0 instead of NaN, their contribution either way."""


class _ChunkScores(NamedTuple):
    logprobs: torch.Tensor  # [rows] the targets' logprobs
    lse: torch.Tensor  # [rows] log-sum-exp of the (tempered, kept) logits
    entropy: torch.Tensor | None  # [rows], when asked
    top_logprobs: torch.Tensor | None  # [rows, top_n] most likely first, when top_n > 0
    top_ids: torch.Tensor | None  # [rows, top_n]


def _score_chunk(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool, top_n: int) -> _ChunkScores:
    """One chunk's scores from its logits `z` (consumed in place). The top-N and the targets' logprobs are the
    same fp32 numbers minus the same normaliser, so a target that is its row's argmax has exactly the top one."""
    top = z.amax(dim=-1, keepdim=True)
    z = z.sub_(top)
    picked = z.gather(1, targets[:, None])
    best = z.topk(top_n, dim=-1) if top_n else None
    entropy = None
    if with_entropy:
        probs = z.exp()
        total = probs.sum(dim=-1, keepdim=True)
        logp = z.sub_(total.log()).clamp_min_(LOGP_FLOOR)
        entropy = -_dot_rows(probs.div_(total), logp)
        del probs, logp
    else:
        total = z.exp_().sum(dim=-1, keepdim=True)
    log_total = total.log()
    return _ChunkScores(
        logprobs=(picked - log_total).view(-1),
        lse=(top + log_total).view(-1),
        entropy=entropy,
        top_logprobs=None if best is None else best.values - log_total,
        top_ids=None if best is None else best.indices,
    )


def _add_weight_grad(
    total: torch.Tensor, grad_z: torch.Tensor, model_grad_z: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """`total + grad_z.T @ hidden` into the fp32 `[V, H]` sum; `model_grad_z` is `grad_z` in the model dtype.

    On CUDA in bf16/fp16 the GEMM runs in the model dtype on tensor cores, accumulating in fp32 (in fp32 it is a
    SIMT SGEMM, without tensor cores: a fifth of the RL trainer's GPU time). Elsewhere it stays in fp32, in place,
    so CPU results match the fp32 reference."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return add_product(total, model_grad_z.T, hidden)
    return total.addmm_(grad_z.T, hidden.float())


class _ChunkedLogprobs(torch.autograd.Function):
    """Per chunk: one fp32 logits buffer, plus one for probabilities when entropy is involved. Saves `lse`."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: torch.Tensor,
        kept_matrix: torch.Tensor | None,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        valid = targets != IGNORE_INDEX
        safe_targets = targets.masked_fill(~valid, 0)
        logprobs = hidden.new_zeros(rows, dtype=torch.float32)
        entropy = hidden.new_zeros(rows, dtype=torch.float32)
        lse = hidden.new_zeros(rows, dtype=torch.float32)
        for s in range(0, rows, chunk_size):
            e = min(s + chunk_size, rows)
            kept = kept_matrix[s:e] if kept_matrix is not None else None
            z = _chunk_logits(hidden[s:e], weight, temperature[s:e], kept)
            scores = _score_chunk(z, safe_targets[s:e], with_entropy, 0)
            del z
            logprobs[s:e], lse[s:e] = scores.logprobs, scores.lse
            if scores.entropy is not None:
                entropy[s:e] = scores.entropy
        logprobs = logprobs.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, safe_targets, valid, temperature, kept_matrix, entropy, lse)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, valid, temperature, kept_matrix, entropy, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        if grad_logprobs is None and grad_entropy is None:
            return grad_hidden, grad_weight, None, None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(entropy)
        grad_logprobs = grad_logprobs * valid
        rows, chunk_size = hidden.shape[0], ctx.chunk_size
        for s in range(0, rows, chunk_size):
            e = min(s + chunk_size, rows)
            kept = kept_matrix[s:e] if kept_matrix is not None else None
            g_lp = grad_logprobs[s:e, None]
            logp = _chunk_logits(hidden[s:e], weight, temperature[s:e], kept).sub_(lse[s:e, None])
            # grad_z = g_logprob * (onehot(target) - p) + g_entropy * (-p * (logp + entropy))
            if grad_entropy is None:
                grad_z = logp.exp_().mul_(-g_lp)
            else:
                probs = logp.exp()
                coef = logp.clamp_min_(LOGP_FLOOR).add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None]).add_(g_lp)
                grad_z = probs.mul_(coef).neg_()
                del probs, coef
            grad_z = grad_z.scatter_add_(1, targets[s:e, None], g_lp).div_(temperature[s:e, None])
            model_grad_z = grad_z.to(hidden.dtype)  # the same tensor in fp32
            if grad_hidden is not None:
                grad_hidden[s:e] = model_grad_z @ weight
            if grad_weight is not None:
                grad_weight = _add_weight_grad(grad_weight, grad_z, model_grad_z, hidden[s:e])
            del grad_z, model_grad_z, logp
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    kept_matrix: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
) -> TokenLogprobs:
    """Logprob of each target under `softmax((hidden @ weight.T) / temperature)`, chunked; differentiable.

    hidden `[..., H]`, weight `[V, H]`, targets `[...]` (IGNORE_INDEX = -100 gives logprob 0 and no gradient).
    temperature: a float or a tensor broadcastable to `targets` (e.g. one per sample, shape `[B, 1]`).
    kept_matrix `[..., K]`: per token, its kept ids, the ids sampling could draw (padded with -1; all -1 = whole
    vocabulary); the distribution is renormalised over them, and a target outside them gets logprob -inf.
    """
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).expand(shape).reshape(-1)
    kept = kept_matrix.reshape(flat_hidden.shape[0], -1) if kept_matrix is not None else None
    logprobs, entropy = _ChunkedLogprobs.apply(
        flat_hidden, weight, targets.reshape(-1), temps.contiguous(), kept, chunk_size, with_entropy
    )
    return TokenLogprobs(logprobs.view(shape), entropy.view(shape) if with_entropy else None)


class ScoredTokens(NamedTuple):
    logprobs: torch.Tensor  # [N] fp32: each target's logprob
    top_logprobs: torch.Tensor  # [N, top_n] fp32, most likely first
    top_ids: torch.Tensor  # [N, top_n] int64


@torch.no_grad()
def score_tokens(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    top_n: int,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> ScoredTokens:
    """Inference scoring under the model's own distribution (temperature 1, nothing truncated), chunked.

    hidden `[N, H]`, weight `[V, H]`, targets `[N]`: the logprobs `token_logprobs` gives (the same per-chunk
    code), and each row's `top_n` most likely ids with their logprobs, from the same fp32 values.
    """
    rows = hidden.shape[0]
    logprobs = hidden.new_empty(rows, dtype=torch.float32)
    top_logprobs = hidden.new_empty(rows, top_n, dtype=torch.float32)
    top_ids = torch.empty(rows, top_n, dtype=torch.long, device=hidden.device)
    ones = torch.ones(min(rows, chunk_size), dtype=torch.float32, device=hidden.device)
    for s in range(0, rows, chunk_size):
        e = min(s + chunk_size, rows)
        z = _chunk_logits(hidden[s:e], weight, ones[: e - s], None)
        scores = _score_chunk(z, targets[s:e], False, top_n)
        del z
        logprobs[s:e] = scores.logprobs
        if top_n:
            top_logprobs[s:e], top_ids[s:e] = scores.top_logprobs, scores.top_ids
    return ScoredTokens(logprobs, top_logprobs, top_ids)


def cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """SFT loss: `-token_logprobs` over non-ignored targets, reduced by `mean` (over valid tokens), `sum` or `none`."""
    nll = -token_logprobs(hidden, weight, targets, chunk_size=chunk_size, with_entropy=False).logprobs
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def reference_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    kept_matrix: torch.Tensor | None = None,
) -> TokenLogprobs:
    """The same quantities computed the plain way, with full logits; the baseline for tests and benchmarks."""
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device)
    logits = (hidden @ weight.T).float() / temperature[..., None]
    if kept_matrix is not None:
        kept = kept_mask(kept_matrix.reshape(-1, kept_matrix.shape[-1]), weight.shape[0]).view(logits.shape)
        logits = logits.masked_fill(~kept, float("-inf"))
    logp = logits.log_softmax(dim=-1)
    valid = targets != IGNORE_INDEX
    picked = logp.gather(-1, targets.masked_fill(~valid, 0)[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(dim=-1)
    return TokenLogprobs(picked.masked_fill(~valid, 0.0), entropy)
