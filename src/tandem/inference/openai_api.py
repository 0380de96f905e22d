"""OpenAI request bodies to engine prompts and parameters, and engine records to OpenAI response bodies.

Pure functions over `protocol` models and the tokenizer; the HTTP plumbing is in `server.py`. Logprobs are
the engine's (docs/inference.md#sampling); token strings are each token decoded on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from tandem.envs.tool_parsers import ToolParser
from tandem.inference import tool_calls
from tandem.inference.outputs import PromptLogprobs, SampleRecord, SampleUpdate, TopLogprobs
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

Sample = TypeVar("Sample", SampleRecord, SampleUpdate)


class RequestError(ValueError):
    """A request that is well-formed but cannot be served as asked (HTTP 400)."""


def completion_prompt_inputs(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts as the request gave them (a string or token ids each)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def completion_prompts(body: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt: strings are tokenized (with the tokenizer's special tokens), ids pass through."""
    prompts = completion_prompt_inputs(body)
    if not prompts:
        raise RequestError("prompt: no prompt given")
    ids = [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise RequestError("prompt: a prompt has no tokens")
    return ids


def completion_sampling(body: CompletionRequest) -> SamplingParams:
    """The engine's parameters. An echo with logprobs scores the prompt too (its top-N as the completion's); with
    max_tokens 0 the engine samples one token that `shown` then hides, as vLLM does."""
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    prompt_logprobs = body.logprobs if body.echo else None
    return body.sampling(max_tokens, body.logprobs or 0).model_copy(update={"prompt_logprobs": prompt_logprobs})


def shown(sample: Sample, body: CompletionRequest) -> Sample:
    """What a completion choice shows of a sample: all of it, or with max_tokens 0 (an echo that only scores the
    prompt) nothing of the token sampled for it; it then finished by "length" (unless aborted), as vLLM says."""
    if body.max_tokens != 0:
        return sample
    finish = sample.finish_reason if sample.finish_reason in (None, "abort") else "length"
    return dataclasses.replace(
        sample,
        token_ids=[],
        logprobs=[],
        masks=[],
        versions=[],
        top_logprobs=[],
        text="",
        finish_reason=finish,
        stop_reason=None,
    )


def echo_texts(body: CompletionRequest, prompts: list[list[int]], tokenizer: Any) -> list[str]:
    """The prompts an echo shows: each text as given, token-id prompts decoded (`prompts`: their ids)."""
    given = completion_prompt_inputs(body)
    return [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(given, prompts, strict=True)]


def echo_logprobs(
    tokenizer: Any, ids: list[int], scores: PromptLogprobs | None, top_n: int
) -> CompletionLogprobs | None:
    """The engine's prompt logprobs in the legacy format (the first token's null), at text offset 0."""
    if scores is None:
        return None
    return completion_logprobs(tokenizer, ids, scores.logprobs, scores.top, top_n, 0)


def joined(first: CompletionLogprobs | None, second: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """An echoed prompt's logprobs followed by the completion's (whose text offsets already count the prompt)."""
    if first is None or second is None:
        return first or second
    tops = None
    if first.top_logprobs is not None and second.top_logprobs is not None:
        tops = first.top_logprobs + second.top_logprobs
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=tops,
        text_offset=first.text_offset + second.text_offset,
    )


def chat_tools(
    tools: Sequence[Any] | None, tool_choice: Any, tokenizer: Any
) -> tuple[list[dict[str, Any]], ToolParser] | None:
    """The tools to render and the parser for the model's calls, or None when no tools are rendered."""
    try:
        rendered = tool_calls.checked_tools(tools, tool_choice)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if rendered is None:
        return None
    try:
        return rendered, tool_calls.reply_parser(getattr(tokenizer, "chat_template", None))
    except ValueError as error:
        raise RequestError(f"tools: this model's tool calls cannot be read: {error}") from None


def chat_prompt(
    body: ChatCompletionRequest, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None
) -> list[int]:
    """The conversation (and `tools`, if any) rendered by the tokenizer's chat template, as token ids."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions")
    messages = [tool_calls.template_message(message.template_dict()) for message in body.messages]
    extra = {"tools": list(tools)} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            **extra,
            **body.chat_template_kwargs,
        )
    except Exception as error:  # template errors (a role it rejects, a missing variable) are the caller's
        raise RequestError(f"messages: the chat template failed: {error}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def chat_reply(text: str, engine_reason: str, parser: ToolParser | None) -> tuple[dict[str, Any], str]:
    """A finished choice's message fields (`content`, and `tool_calls` when tools were rendered) and its finish
    reason (`tool_calls` when the model called one)."""
    if parser is None:
        return {"content": text}, engine_reason
    content, calls = tool_calls.tool_reply(text, parser)
    return {"content": content, "tool_calls": calls}, tool_calls.finish_reason(calls, engine_reason)


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
    logprobs: Sequence[float | None],
    top: Sequence[TopLogprobs | None],
    top_n: int,
    offset: int,
) -> CompletionLogprobs:
    """The legacy completions format; `offset` is the text length before these tokens. None (an echoed prompt's
    first token, which nothing predicts) stays None."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(logprobs),
        top_logprobs=[None if pairs is None else {tokenizer.decode([i]): lp for i, lp in pairs} for pairs in top]
        if top_n
        else None,
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
