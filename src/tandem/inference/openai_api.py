"""OpenAI request bodies to engine prompts and parameters, and engine records to OpenAI response bodies.

Pure functions over `protocol` models and the tokenizer; the HTTP plumbing is in `server.py`. Logprobs are
the engine's (docs/inference.md#sampling); token strings are each token decoded on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.inference.outputs import TopLogprobs
from tandem.inference.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)


class RequestError(ValueError):
    """A request that is well-formed but cannot be served as asked (HTTP 400)."""


def completion_prompts(body: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt: strings are tokenized (with the tokenizer's special tokens), ids pass through."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: Sequence[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]  # type: ignore[list-item]
    else:
        prompts = prompt  # type: ignore[assignment]
    if not prompts:
        raise RequestError("prompt: no prompt given")
    ids = [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise RequestError("prompt: a prompt has no tokens")
    return ids


def completion_sampling(body: CompletionRequest) -> SamplingParams:
    return body.sampling(body.max_tokens, body.logprobs or 0)


def chat_prompt(body: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The conversation rendered by the tokenizer's chat template, as token ids."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions")
    messages = [message.template_dict() for message in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt, **body.chat_template_kwargs
        )
    except Exception as error:  # template errors (a role it rejects, a missing variable) are the caller's
        raise RequestError(f"messages: the chat template failed: {error}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def chat_sampling(body: ChatCompletionRequest) -> SamplingParams:
    if body.top_logprobs and not body.logprobs:
        raise RequestError("top_logprobs: needs logprobs=true")
    return body.sampling(body.max_completion_tokens or body.max_tokens, body.top_logprobs)


def usage(prompt_lengths: Sequence[int], completion_lengths: Sequence[int]) -> Usage:
    prompt, completion = sum(prompt_lengths), sum(completion_lengths)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top: list[TopLogprobs],
    top_n: int,
    offset: int,
) -> CompletionLogprobs:
    """The legacy completions format; `offset` is the text length before these tokens."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=logprobs,
        top_logprobs=[{tokenizer.decode([i]): lp for i, lp in pairs} for pairs in top] if top_n else None,
        text_offset=offsets,
    )


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float], top: list[TopLogprobs]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    alternatives = top or [[] for _ in token_ids]
    return ChatLogprobs(
        content=[
            TokenLogprob(**entry(t, lp), top_logprobs=[TopLogprob(**entry(i, v)) for i, v in pairs])
            for t, lp, pairs in zip(token_ids, logprobs, alternatives, strict=True)
        ]
    )
