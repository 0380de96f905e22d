"""The HTTP server: OpenAI-compatible routes, token-in `/generate`, health, metrics and admin routes.

Handlers run on the asyncio loop; each HTTP request becomes one engine request per prompt (`Batch`), whose
updates the engine thread hands to the loop. Tokenizing, chat templating and rendering a whole response's
logprobs (a decode per token) run on worker threads, so a huge prompt never holds up `/health` or other requests. Reading, parsing and refusing requests, the admin guard and
the `x-queue-depth` header are `http.py`'s, shared with the vLLM routes: a request's body is size-limited and
validated strictly (`protocol.py`); every mistake is a 4xx JSON error and the server carries on. A client that
disconnects cancels its engine requests, which frees their cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from tandem.inference import openai_api
from tandem.inference.client_template import TemplateRefused, check_template_kwargs, with_deadline
from tandem.inference.engine import Collector, Engine
from tandem.inference.http import (
    CLIENT_GONE,
    DEFAULT_MAX_BODY_BYTES,
    AdminGuard,
    HTTPError,
    QueueDepthHeader,
    check_model,
    check_version_order,
    client_gone,
    describe,
    encoded_response,
    endpoint,
    error_body,
    json_response,
    parse,
    sse,
)
from tandem.inference.outputs import RequestUpdate, SampleRecord, SampleUpdate
from tandem.inference.prompt_tokens import ContextTokenizer
from tandem.inference.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    EngineStatus,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    PromptOutput,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from tandem.inference.tool_calls import ToolStream
from tandem.inference.weights import ForbiddenWeightsPath, WeightsError, read_weights, resolve_weights_path
from tandem.inference.weights_receiver import ReceiverEndpoint

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class Batch:
    """The engine requests behind one HTTP request, one per prompt; their updates arrive on one queue."""

    def __init__(
        self, engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int, *, stream: bool, text: bool
    ) -> None:
        try:  # every prompt, before anything is made or queued for any
            for prompt in prompts:
                engine.check(prompt, params, n=n, detokenize=text)
        except ValueError as error:
            raise HTTPError(400, str(error)) from None
        loop = asyncio.get_running_loop()
        self.engine = engine
        self.prompts = prompts
        self.updates: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()
        self.collectors = [Collector(n) for _ in prompts]
        self.ids: list[str] = []
        try:
            for index, prompt in enumerate(prompts):
                deliver = partial(self._deliver, loop, index)
                self.ids.append(engine.submit(prompt, params, deliver, n=n, stream=stream, detokenize=text))
        except ValueError as error:
            self.cancel()
            raise HTTPError(400, str(error)) from None
        except RuntimeError as error:  # the engine is not running
            self.cancel()
            raise HTTPError(503, str(error), "server_error") from None

    def _deliver(self, loop: asyncio.AbstractEventLoop, index: int, update: RequestUpdate) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the server is shutting down
            loop.call_soon_threadsafe(self.updates.put_nowait, (index, update))

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.collectors)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.collectors if c.error), None)

    async def next(self) -> tuple[int, list[SampleUpdate]]:
        index, update = await self.updates.get()
        return index, self.collectors[index].add(update)

    async def wait(self) -> None:
        while not self.finished:
            await self.next()

    def cancel(self) -> None:
        for request_id, collector in zip(self.ids, self.collectors, strict=False):
            if not collector.finished:
                self.engine.cancel(request_id)

    async def finish_unless_gone(self, request: Request) -> bool:
        """Wait for every engine request; False (and cancelled) if the client went away first."""
        waiter, gone = asyncio.ensure_future(self.wait()), asyncio.ensure_future(client_gone(request))
        try:
            done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            waiter.cancel()
            gone.cancel()
            if not self.finished:
                self.cancel()
        if waiter not in done:
            return False
        if self.error:
            raise HTTPError(500, self.error, kind="server_error")
        return True


async def _stream(
    batch: Batch,
    render: Callable[[int, SampleUpdate], Awaitable[BaseModel | None]],
    tail: Callable[[], list[BaseModel]],
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per sample update (`render` may hand slow work to a thread), then `tail()`
    (e.g. usage), then `[DONE]`."""
    try:
        while not batch.finished:
            index, samples = await batch.next()
            for sample in samples:
                chunk = await render(index, sample)
                if chunk is not None:
                    yield sse(chunk)
        if batch.error:
            yield sse(error_body(500, batch.error, "server_error"))
            return
        for chunk in tail():
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    finally:
        batch.cancel()


class InferenceServer:
    """The routes over one engine and its tokenizer."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        *,
        admin_token: str | None,
        weights_dir: Path,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        trust_request_chat_template: bool = False,
        broadcast_hosts: Sequence[str] = (),
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.prompt_tokenizer = ContextTokenizer(tokenizer, engine.max_model_len)
        self.weights_dir, self.max_body_bytes = weights_dir, max_body_bytes
        self.trust_request_chat_template = trust_request_chat_template
        self.admin = AdminGuard(admin_token)
        self.created = int(time.time())
        self._weights_lock = asyncio.Lock()
        # the trainer's in-memory weight hand-off (weights_receiver.py)
        self.receiver = ReceiverEndpoint(engine, broadcast_hosts)

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", endpoint(self.health), methods=["GET"]),
            Route("/metrics", endpoint(self.metrics), methods=["GET"]),
            Route("/v1/models", endpoint(self.models), methods=["GET"]),
            Route("/v1/completions", endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", endpoint(self.chat_completions), methods=["POST"]),
            Route("/generate", endpoint(self.generate), methods=["POST"]),
            Route("/update_weights", endpoint(self.admin(self.update_weights)), methods=["POST"]),
            Route("/pause", endpoint(self.admin(self.pause)), methods=["POST"]),
            Route("/resume", endpoint(self.admin(self.resume)), methods=["POST"]),
            Route("/weights/join", endpoint(self.admin(self.receiver.join_route)), methods=["POST"]),
            Route("/weights", endpoint(self.receiver.status_route), methods=["GET"]),
        ]
        return QueueDepthHeader(Starlette(routes=routes), lambda: self.engine.gauges.waiting_requests)

    # --- shared checks, tokenizing off the loop ---

    async def _parse(self, request: Request, model: type[M]) -> M:
        return await parse(request, model, self.max_body_bytes)

    def _check_model(self, name: str | None) -> None:
        check_model(name, self.model_name)

    async def _chat_prompt(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
        """The rendered, tokenized conversation, on a worker thread (under a deadline when the request brings its
        own template)."""
        try:
            own = check_template_kwargs(
                body.chat_template_kwargs, trust_request_template=self.trust_request_chat_template
            )
        except TemplateRefused as error:
            raise HTTPError(400, str(error), param="chat_template_kwargs") from None
        render = partial(openai_api.chat_prompt, body, self.prompt_tokenizer, tools)
        return await asyncio.to_thread(partial(with_deadline, render) if own else render)

    def _status(self) -> EngineStatus:
        alive = self.engine.alive
        return EngineStatus(
            status="ok" if alive else "error",
            paused=self.engine.paused,
            policy_version=self.engine.version,
            error=None if alive else self.engine.error or "the engine thread is not running",
        )

    # --- routes ---

    async def health(self, request: Request) -> Response:
        status = self._status()
        return json_response(status, 200 if status.status == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        stats = self.engine.stats()
        used = stats.kv_blocks_used / stats.kv_blocks_total
        values = [
            ("requests_running", "gauge", "sequences in the running batch", stats.running),
            ("requests_waiting", "gauge", "requests queued for admission", stats.waiting_requests),
            ("kv_cache_usage", "gauge", "fraction of KV-cache blocks in use", used),
            ("kv_cache_blocks_used", "gauge", "KV-cache blocks in use", stats.kv_blocks_used),
            ("kv_cache_blocks_total", "gauge", "KV-cache blocks", stats.kv_blocks_total),
            ("tokens_per_second", "gauge", "generated tokens per second, last 10 s", stats.tokens_per_s),
            ("generated_tokens_total", "counter", "tokens generated", stats.generated_tokens),
            ("prompt_tokens_total", "counter", "prompt tokens admitted", stats.prompt_tokens),
            ("requests_finished_total", "counter", "requests ended (aborted ones included)", stats.requests_finished),
            (
                "requests_aborted_total",
                "counter",
                "requests aborted (cancelled, disconnected, failed)",
                stats.requests_aborted,
            ),
            ("preemptions_total", "counter", "sequences preempted for KV-cache room", stats.preemptions),
            ("engine_steps_total", "counter", "engine steps", stats.steps),
            (
                "overlapped_steps_total",
                "counter",
                "decode steps launched before the last one's tokens were read",
                stats.overlapped_steps,
            ),
            ("policy_version", "gauge", "policy version of the current weights", stats.policy_version),
            ("paused", "gauge", "1 while paused", int(stats.paused)),
        ]
        lines = []
        for name, kind, help_text, value in values:
            lines += [f"# HELP tandem_{name} {help_text}", f"# TYPE tandem_{name} {kind}", f"tandem_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len)
        return json_response(ModelList(data=[card]))

    async def generate(self, request: Request) -> Response:
        """Token ids in, token ids, logprobs and masks out; in JSON or msgpack (`Content-Type`, `Accept`)."""
        body = await parse(request, GenerateRequest, self.max_body_bytes, msgpack=True)
        self._check_model(body.model)
        params = body.sampling
        batch = Batch(self.engine, body.prompts, params, body.n, stream=False, text=False)
        if not await batch.finish_unless_gone(request):
            return Response(status_code=CLIENT_GONE)
        outputs = [
            PromptOutput(
                prompt_token_count=len(prompt),
                samples=[s.to_output(with_masks=params.truncates, with_top=params.top_logprobs > 0) for s in c.samples],
                prompt_logprobs=c.prompt_logprobs.logprobs if c.prompt_logprobs else None,
                prompt_top_logprobs=c.prompt_logprobs.top if c.prompt_logprobs and params.prompt_logprobs else None,
            )
            for prompt, c in zip(batch.prompts, batch.collectors, strict=True)
        ]
        response = GenerateResponse(
            id=f"gen-{uuid.uuid4().hex}", model=self.model_name, policy_version=self.engine.version, outputs=outputs
        )
        return encoded_response(request, response)

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        try:
            prompts = await asyncio.to_thread(openai_api.completion_prompts, body, self.prompt_tokenizer)
            params = openai_api.completion_sampling(body)
        except ValidationError as error:
            raise HTTPError(400, describe(error)) from None
        except openai_api.RequestError as error:
            raise HTTPError(400, str(error)) from None
        echoed: list[str] = []  # decoding a long prompt takes a while: off the loop, as tokenizing it was
        if body.echo:
            echoed = await asyncio.to_thread(openai_api.echo_texts, body, prompts, self.tokenizer)
        batch = Batch(self.engine, prompts, params, body.n, stream=body.stream, text=True)
        response_id, want_logprobs = f"cmpl-{uuid.uuid4().hex}", body.logprobs is not None
        echo_scores: dict[int, CompletionLogprobs | None] = {}

        async def score_echoes(indices: list[int]) -> None:
            """The echoed prompts' logprobs in the legacy format, once per prompt (its n choices share them) and
            off the loop: a long prompt is as many token decodes as it has tokens, times its top-N."""

            def render() -> None:
                for i in indices:
                    scores = batch.collectors[i].prompt_logprobs
                    echo_scores[i] = openai_api.echo_logprobs(self.tokenizer, prompts[i], scores, body.logprobs or 0)

            if body.echo and want_logprobs and (indices := [i for i in indices if i not in echo_scores]):
                await asyncio.to_thread(render)

        def choice(number: int, sample: SampleRecord | SampleUpdate, offset: int, *, first: bool) -> CompletionChoice:
            """Choice `number` showing `sample` (after `offset` characters of the choice's own text); with echo, the
            prompt comes before it: its text and scored tokens in the first chunk, its length in every offset."""
            prompt, top_n = number // body.n, body.logprobs or 0
            before = len(echoed[prompt]) if body.echo else 0
            lp, text = None, sample.text
            if want_logprobs:
                tokens, lps, top = sample.token_ids, sample.logprobs, sample.top_logprobs
                lp = openai_api.completion_logprobs(self.tokenizer, tokens, lps, top, top_n, before + offset)
            if body.echo and first:
                text = echoed[prompt] + text
                if want_logprobs:
                    lp = openai_api.joined(echo_scores[prompt], lp)
            return CompletionChoice(
                index=number,
                text=text,
                logprobs=lp,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
                token_ids=sample.token_ids if body.return_token_ids else None,
            )

        def response(choices: list[CompletionChoice], usage: Any = None) -> CompletionResponse:
            return CompletionResponse(
                id=response_id, created=int(time.time()), model=self.model_name, choices=choices, usage=usage
            )

        def usage() -> Any:
            completions = [len(openai_api.shown(s, body).token_ids) for c in batch.collectors for s in c.samples]
            return openai_api.usage([len(p) for p in prompts], completions)

        if body.stream:
            text_length: dict[int, int] = {}

            async def render(index: int, sample: SampleUpdate) -> BaseModel | None:
                sample, number = openai_api.shown(sample, body), index * body.n + sample.sample
                first, offset = number not in text_length, text_length.get(number, 0)
                text_length[number] = offset + len(sample.text)
                if not (sample.text or sample.finish_reason or want_logprobs or (first and body.echo)):
                    return None
                if first:
                    await score_echoes([index])
                return response([choice(number, sample, offset, first=first)])

            with_usage = body.stream_options is not None and body.stream_options.include_usage
            tail = lambda: [response([], usage())] if with_usage else []  # noqa: E731
            return StreamingResponse(_stream(batch, render, tail), media_type="text/event-stream")
        if not await batch.finish_unless_gone(request):
            return Response(status_code=CLIENT_GONE)
        await score_echoes(list(range(len(prompts))))

        def finished() -> list[CompletionChoice]:
            choices = [
                choice(index * body.n + s, openai_api.shown(record, body), 0, first=True)
                for index, collector in enumerate(batch.collectors)
                for s, record in enumerate(collector.samples)
            ]
            for done in choices:
                done.finish_reason = done.finish_reason or "abort"
            return choices

        # logprobs decode every token of every choice (and its top-N): off the loop, as tokenizing was
        choices = await asyncio.to_thread(finished) if want_logprobs else finished()
        return json_response(response(choices, usage()))

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        try:
            tools = openai_api.chat_tools(body.tools, body.tool_choice, self.prompt_tokenizer)
            prompt = await self._chat_prompt(body, tools and tools[0])
            params = openai_api.chat_sampling(body)
        except ValidationError as error:
            raise HTTPError(400, describe(error)) from None
        except openai_api.RequestError as error:
            raise HTTPError(400, str(error)) from None
        parser = tools and tools[1]
        batch = Batch(self.engine, [prompt], params, body.n, stream=body.stream, text=True)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(token_ids: list[int], lps: list[float], top: list) -> Any:
            return openai_api.chat_logprobs(self.tokenizer, token_ids, lps, top) if body.logprobs else None

        def usage() -> Any:
            return openai_api.usage([len(prompt)], [len(s.token_ids) for s in batch.collectors[0].samples])

        if body.stream:

            def chunk(choices: list[ChatChunkChoice], usage: Any = None) -> ChatCompletionChunk:
                return ChatCompletionChunk(
                    id=response_id, created=created, model=self.model_name, choices=choices, usage=usage
                )

            streams = [ToolStream(parser) for _ in range(body.n)] if parser else None

            async def render(index: int, sample: SampleUpdate) -> BaseModel | None:
                text, calls, finish = sample.text, None, sample.finish_reason
                if streams is not None:  # tool calls are held back and sent whole in the choice's last delta
                    text, calls, finish = streams[sample.sample].update(sample.text, sample.finish_reason)
                if not (text or finish or body.logprobs):
                    return None
                choice = ChatChunkChoice(
                    index=sample.sample,
                    delta=ChatDelta(content=text, tool_calls=calls),
                    logprobs=logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs),
                    finish_reason=finish,
                    token_ids=sample.token_ids if body.return_token_ids else None,
                )
                return chunk([choice])

            async def events() -> AsyncIterator[str]:
                for i in range(body.n):
                    yield sse(chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
                with_usage = body.stream_options is not None and body.stream_options.include_usage
                async for event in _stream(batch, render, lambda: [chunk([], usage())] if with_usage else []):
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream")
        if not await batch.finish_unless_gone(request):
            return Response(status_code=CLIENT_GONE)

        def finished() -> list[ChatChoice]:
            choices = []
            for s, record in enumerate(batch.collectors[0].samples):
                message, finish = openai_api.chat_reply(record.text, record.finish_reason or "abort", parser)
                choices.append(
                    ChatChoice(
                        index=s,
                        message=AssistantMessage(**message),
                        logprobs=logprobs(record.token_ids, record.logprobs, record.top_logprobs),
                        finish_reason=finish,
                        stop_reason=record.stop_reason,
                        token_ids=record.token_ids if body.return_token_ids else None,
                    )
                )
            return choices

        choices = await asyncio.to_thread(finished) if body.logprobs else finished()  # off the loop, as above
        response = ChatCompletionResponse(
            id=response_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage(),
            prompt_token_ids=prompt if body.return_token_ids else None,
        )
        return json_response(response)

    async def update_weights(self, request: Request) -> Response:
        body = await self._parse(request, UpdateWeightsRequest)
        async with self._weights_lock:
            check_version_order(body.version, self.engine.version, body.rollback)
            started = time.monotonic()
            try:
                path = resolve_weights_path(body.path, self.weights_dir)
                tensors = await asyncio.to_thread(read_weights, path, self.engine.model)
            except WeightsError as error:
                status = 403 if isinstance(error, ForbiddenWeightsPath) else 400
                raise HTTPError(status, str(error), param="path") from None
            load_s = time.monotonic() - started
            pause_s = await asyncio.wrap_future(self.engine.swap_weights(tensors, body.version))
        logger.info("loaded %s as policy version %d (read %.2f s, paused %.3f s)", path, body.version, load_s, pause_s)
        return json_response(UpdateWeightsResponse(policy_version=self.engine.version, load_s=load_s, pause_s=pause_s))

    async def pause(self, request: Request) -> Response:
        await asyncio.wrap_future(self.engine.pause())
        return json_response(self._status())

    async def resume(self, request: Request) -> Response:
        await asyncio.wrap_future(self.engine.resume())
        return json_response(self._status())
