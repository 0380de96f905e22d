"""OpenAI request bodies to engine prompts and parameters, and the engine's samples to OpenAI response bodies.

Functions over `protocol` models and the tokenizer, and per route a reply (`CompletionReply`, `ChatReply`) that
assembles one request's response objects: whole, or chunk by chunk when streamed. The routes (`server.py`) only
drive the engine and decide what runs on a worker thread. Logprobs are the engine's
(docs/inference.md#sampling); token strings are each token decoded on its own.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from tandem.envs.tool_parsers import ToolParser
from tandem.inference import tool_calls
from tandem.inference.limits import RequestRefused
from tandem.inference.outputs import Collector, PromptLogprobs, SampleRecord, SampleUpdate, TopLogprobs
from tandem.wire.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)

RecordOrUpdate = TypeVar("RecordOrUpdate", SampleRecord, SampleUpdate)
"""A sample whole (non-streaming) or what one update added to it (streaming): `shown` returns the same kind."""


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
        raise RequestRefused("prompt: no prompt given")
    ids = [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise RequestRefused("prompt: a prompt has no tokens")
    return ids


def completion_sampling(body: CompletionRequest) -> SamplingParams:
    """The engine's parameters. An echo with logprobs scores the prompt too (its top-N as the completion's); with
    max_tokens 0 the engine samples one token that `shown` then hides, as vLLM does."""
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    prompt_logprobs = body.logprobs if body.echo else None
    return body.sampling(max_tokens, body.logprobs or 0).model_copy(update={"prompt_logprobs": prompt_logprobs})


def shown(sample: RecordOrUpdate, body: CompletionRequest) -> RecordOrUpdate:
    """What a completion choice shows of a sample: all of it, or with max_tokens 0 (an echo that only scores the
    prompt) nothing of the token sampled for it; it then finished by "length" (unless aborted), as vLLM says."""
    if body.max_tokens != 0:
        return sample
    finish = sample.finish_reason if sample.finish_reason in (None, "abort") else "length"
    return dataclasses.replace(
        sample,
        token_ids=[],
        logprobs=[],
        encoded_kept_ids=[],
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
        raise RequestRefused(str(error)) from None
    if rendered is None:
        return None
    try:
        return rendered, tool_calls.reply_parser(getattr(tokenizer, "chat_template", None))
    except ValueError as error:
        raise RequestRefused(f"tools: this model's tool calls cannot be read: {error}") from None


def chat_prompt(
    body: ChatCompletionRequest, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None
) -> list[int]:
    """The conversation (and `tools`, if any) rendered by the tokenizer's chat template, as token ids."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestRefused("this model's tokenizer has no chat template; use /v1/completions")
    messages = [tool_calls.template_message(m.template_dict(), f"messages[{i}]") for i, m in enumerate(body.messages)]
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
        raise RequestRefused(f"messages: the chat template failed: {error}") from None
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
        raise RequestRefused("top_logprobs: needs logprobs=true")
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


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


class CompletionReply:
    """The response objects of one /v1/completions request. Choice `index * n + s` shows sample s of prompt
    `index`; with echo, a choice's first chunk starts with its prompt (the text, and with logprobs its scored
    tokens) and every text offset counts the prompt."""

    def __init__(
        self, body: CompletionRequest, tokenizer: Any, model: str, prompts: list[list[int]], echoed: list[str]
    ) -> None:
        self.body, self.tokenizer, self.model = body, tokenizer, model
        self.prompts, self.echoed = prompts, echoed
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.logprobs = body.logprobs is not None
        self.echo_scores: dict[int, CompletionLogprobs | None] = {}
        self._text_length: dict[int, int] = {}
        """Streamed: the characters each choice has sent."""

    def unscored(self, indices: Iterable[int]) -> list[int]:
        """The prompts among `indices` whose echoed logprobs are still to render (none without echo and logprobs)."""
        if not (self.body.echo and self.logprobs):
            return []
        return [i for i in indices if i not in self.echo_scores]

    def score_echoes(self, collectors: Sequence[Collector], indices: list[int]) -> None:
        """The echoed prompts' logprobs, once per prompt (its n choices share them). A long prompt is as many token
        decodes as it has tokens, times its top-N: call it on a worker thread."""
        for i in indices:
            scores = collectors[i].prompt_logprobs
            self.echo_scores[i] = echo_logprobs(self.tokenizer, self.prompts[i], scores, self.body.logprobs or 0)

    def chunk(self, index: int, update: SampleUpdate) -> CompletionResponse | None:
        """The streamed chunk of an update of prompt `index`'s sample; None when it has nothing to show."""
        body = self.body
        sample, number = shown(update, body), index * body.n + update.sample
        first, offset = number not in self._text_length, self._text_length.get(number, 0)
        self._text_length[number] = offset + len(sample.text)
        if not (sample.text or sample.finish_reason or self.logprobs or (first and body.echo)):
            return None
        return self._response([self._choice(number, sample, offset, first=first)])

    def tail(self, collectors: Sequence[Collector]) -> list[CompletionResponse]:
        """What a stream sends after its last chunk: the usage, when `stream_options.include_usage` asks."""
        return [self._response([], self._usage(collectors))] if _include_usage(self.body) else []

    def whole(self, collectors: Sequence[Collector]) -> CompletionResponse:
        """The response of a request not streamed, its samples finished and its echoes scored. With logprobs it
        decodes every token of every choice (and its top-N): call it on a worker thread."""
        choices = [
            self._choice(index * self.body.n + s, shown(record, self.body), 0, first=True)
            for index, collector in enumerate(collectors)
            for s, record in enumerate(collector.samples)
        ]
        for done in choices:
            done.finish_reason = done.finish_reason or "abort"
        return self._response(choices, self._usage(collectors))

    def _choice(
        self, number: int, sample: SampleRecord | SampleUpdate, offset: int, *, first: bool
    ) -> CompletionChoice:
        """Choice `number` showing `sample`, after `offset` characters of the choice's own text."""
        body = self.body
        prompt, top_n = number // body.n, body.logprobs or 0
        before = len(self.echoed[prompt]) if body.echo else 0
        lp, text = None, sample.text
        if self.logprobs:
            tokens, lps, top = sample.token_ids, sample.logprobs, sample.top_logprobs
            lp = completion_logprobs(self.tokenizer, tokens, lps, top, top_n, before + offset)
        if body.echo and first:
            text = self.echoed[prompt] + text
            if self.logprobs:
                lp = joined(self.echo_scores[prompt], lp)
        return CompletionChoice(
            index=number,
            text=text,
            logprobs=lp,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            token_ids=sample.token_ids if body.return_token_ids else None,
        )

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=int(time.time()), model=self.model, choices=choices, usage=usage)

    def _usage(self, collectors: Sequence[Collector]) -> Usage:
        completions = [len(shown(s, self.body).token_ids) for c in collectors for s in c.samples]
        return usage([len(p) for p in self.prompts], completions)


class ChatReply:
    """The response objects of one /v1/chat/completions request: one prompt, n choices. With tools, a streamed
    choice's calls are held back and sent whole in its last delta (`tool_calls.ToolStream`)."""

    def __init__(
        self, body: ChatCompletionRequest, tokenizer: Any, model: str, prompt: list[int], parser: ToolParser | None
    ) -> None:
        self.body, self.tokenizer, self.model = body, tokenizer, model
        self.prompt, self.parser = prompt, parser
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self._streams = [tool_calls.ToolStream(parser) for _ in range(body.n)] if parser and body.stream else None

    def opening(self) -> list[ChatCompletionChunk]:
        """A stream's first chunks: each choice's assistant role."""
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.body.n)
        ]

    def parses(self, update: SampleUpdate) -> bool:
        """Whether `chunk(update)` parses a whole reply's tool calls (its choice's last update, with tools): the
        work of a reply's length, for a worker thread."""
        return self._streams is not None and update.finish_reason is not None

    def chunk(self, update: SampleUpdate) -> ChatCompletionChunk | None:
        """The streamed chunk of a sample's update; None when it has nothing to show."""
        text, calls, finish = update.text, None, update.finish_reason
        if self._streams is not None:
            text, calls, finish = self._streams[update.sample].update(update.text, update.finish_reason)
        if not (text or finish or self.body.logprobs):
            return None
        choice = ChatChunkChoice(
            index=update.sample,
            delta=ChatDelta(content=text, tool_calls=calls),
            logprobs=self._logprobs(update),
            finish_reason=finish,
            token_ids=update.token_ids if self.body.return_token_ids else None,
        )
        return self._chunk([choice])

    def tail(self, collector: Collector) -> list[ChatCompletionChunk]:
        """What a stream sends after its last chunk: the usage, when `stream_options.include_usage` asks."""
        return [self._chunk([], self._usage(collector))] if _include_usage(self.body) else []

    def whole(self, collector: Collector) -> ChatCompletionResponse:
        """The response of a request not streamed, its samples finished. With logprobs it decodes every token of
        every choice (and its top-N): call it on a worker thread."""
        choices = []
        for s, record in enumerate(collector.samples):
            message, finish = chat_reply(record.text, record.finish_reason or "abort", self.parser)
            choices.append(
                ChatChoice(
                    index=s,
                    message=AssistantMessage(**message),
                    logprobs=self._logprobs(record),
                    finish_reason=finish,
                    stop_reason=record.stop_reason,
                    token_ids=record.token_ids if self.body.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._usage(collector),
            prompt_token_ids=self.prompt if self.body.return_token_ids else None,
        )

    def _logprobs(self, sample: SampleRecord | SampleUpdate) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.tokenizer, sample.token_ids, sample.logprobs, sample.top_logprobs)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _usage(self, collector: Collector) -> Usage:
        return usage([len(self.prompt)], [len(s.token_ids) for s in collector.samples])
