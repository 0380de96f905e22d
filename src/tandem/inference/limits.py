"""What a server refuses to serve, checked for each prompt of a request before anything is made or queued for it.

The request models (`tandem.wire.protocol`) check what a body alone can tell; `check_prompt` checks what only the server
knows: its vocabulary, context, logprob cap, what its engine can return and, for the built-in engine, its batch
and KV cache. Both engines fill a `ServerLimits` and call this one function, so a request refused by one is
refused by the other with the same words. Standard library and `protocol` only: no torch, no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.wire.protocol import SamplingParams, context_room


class RequestRefused(ValueError):
    """A well-formed request the server will not serve as asked; the message says what to change. `status` (400
    unless a subclass says otherwise) and `param` (the field at fault) become its HTTP answer (`http.refusals`)."""

    status = 400
    param: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


@dataclass(frozen=True)
class BatchLimits:
    """The built-in engine's batch and KV cache: a request's samples fork from one prefill, so they must all fit
    the running batch and the cache at once (vLLM schedules its samples on its own)."""

    block_size: int
    usable_blocks: int
    """KV blocks a request may hold: all but the scratch block and the scheduler's free reserve."""
    max_running: int
    max_prefill_tokens: int
    blocks_to_admit: Callable[[int, int], int]
    """The scheduler's rule: free blocks a prompt chunk of so many tokens and so many samples need to start."""


@dataclass(frozen=True)
class ServerLimits:
    """What one server can serve; each engine fills one (`Engine.limits`; the vLLM routes from vLLM's model
    config)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    text: bool
    """Whether the engine can produce text (stop strings, detokenized output): it has a tokenizer."""
    batch: BatchLimits | None = None
    replays_truncation: bool = True
    """Whether the engine returns the kept ids that let the trainer replay top-k/top-p/min-p sampling."""
    prompt_logprobs: bool = True
    """Whether `/generate` can return prompt logprobs."""


def check_prompt(
    prompt: list[int], params: SamplingParams, limits: ServerLimits, *, n: int = 1, detokenize: bool = False
) -> int:
    """RequestRefused (naming the problem) unless the server can sample `prompt` `n` times with `params`; returns
    the tokens it may generate (`max_tokens`, or the rest of the context)."""
    if params.truncates and not limits.replays_truncation:
        raise RequestRefused(
            "vLLM returns no kept ids, so the trainer cannot replay top-k/top-p/min-p sampling exactly: "
            "sample with top_k 0, top_p 1 and min_p 0, or start the server with `exact_replay = false` "
            "(the trainer then renormalises over the whole vocabulary)",
            param="sampling",
        )
    if params.prompt_logprobs is not None and not limits.prompt_logprobs:  # the caller would read nulls as unasked
        raise RequestRefused(
            "prompt_logprobs on /generate is served by the built-in engine only; with vLLM use "
            "/v1/completions with echo and logprobs (vLLM's own)",
            param="sampling.prompt_logprobs",
        )
    if not prompt:
        raise RequestRefused("the prompt has no tokens")
    if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
        raise RequestRefused(f"prompt token ids must lie in [0, {limits.vocab_size})")
    try:
        max_tokens = context_room(len(prompt), params.max_tokens, limits.max_model_len)
    except ValueError as error:
        raise RequestRefused(str(error)) from None
    if limits.batch is not None:
        _check_batch(len(prompt), max_tokens, n, limits.batch)
    if params.top_logprobs > limits.max_logprobs:
        raise RequestRefused(f"top_logprobs={params.top_logprobs} is above the server's max_logprobs")
    if (params.prompt_logprobs or 0) > limits.max_logprobs:
        raise RequestRefused(f"prompt_logprobs={params.prompt_logprobs} is above the server's max_logprobs")
    if (params.stop or detokenize) and not limits.text:
        raise RequestRefused("stop strings and text output need a tokenizer; this engine has none")
    if any(not 0 <= t < limits.vocab_size for t in params.stop_token_ids):
        raise RequestRefused(f"stop_token_ids must lie in [0, {limits.vocab_size})")
    if any(not 0 <= t < limits.vocab_size for t in params.logit_bias):
        raise RequestRefused(f"logit_bias token ids must lie in [0, {limits.vocab_size})")
    return max_tokens


def _check_batch(prompt_tokens: int, max_tokens: int, n: int, batch: BatchLimits) -> None:
    blocks = -(-(prompt_tokens + max_tokens) // batch.block_size)
    if blocks > batch.usable_blocks:
        raise RequestRefused(
            f"prompt plus max_tokens ({prompt_tokens + max_tokens} tokens) needs {blocks} KV-cache blocks; "
            f"the server has {batch.usable_blocks} (raise kv_cache_blocks, or lower max_tokens)"
        )
    if n > batch.max_running:
        raise RequestRefused(f"n={n} is more than the server runs at once (max_running={batch.max_running})")
    admit = batch.blocks_to_admit(min(prompt_tokens, batch.max_prefill_tokens), n)
    if admit > batch.usable_blocks:  # it would wait forever, and every request queued after it too
        raise RequestRefused(
            f"n={n} samples of this prompt need {admit} KV-cache blocks free at once to start (its first prompt "
            f"chunk, and a block for each other sample); the server has {batch.usable_blocks} (lower n)"
        )
