"""The HTTP server: OpenAI-compatible routes, token-in `/generate`, health, metrics and admin routes.

Handlers run on the asyncio loop; each HTTP request becomes one engine request per prompt (`Batch`), whose
updates the engine thread hands to the loop. A request's body is validated strictly (`protocol.py`); every
mistake is a 4xx JSON error `{"error": {"message", "type", "param"}}` and the server carries on. A client
that disconnects cancels its engine requests, which frees their cache. Admin routes need the bearer token
when one is configured (always when binding beyond loopback). Every response carries `x-queue-depth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.inference import openai_api
from tandem.inference.engine import Collector, Engine
from tandem.inference.outputs import RequestUpdate, SampleUpdate
from tandem.inference.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
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
from tandem.inference.weights import ForbiddenWeightsPath, WeightsError, read_weights, resolve_weights_path
from tandem.inference.weights_broadcast import BroadcastEndpoint

logger = logging.getLogger(__name__)

QUEUE_DEPTH_HEADER = "x-queue-depth"
CLIENT_GONE = 499
M = TypeVar("M", bound=BaseModel)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _describe(error: ValidationError) -> str:
    """A validation error as `field: problem; ...` (the first few)."""
    parts = []
    for item in error.errors(include_url=False)[:6]:
        where = ".".join(str(part) for part in item["loc"])
        if item["type"] == "json_invalid":
            parts.append(f"invalid JSON: {item['msg']}")
        elif item["type"] == "extra_forbidden":
            parts.append(f"unknown field `{where}`")
        else:
            parts.append(f"{where or 'body'}: {item['msg']}")
    return "; ".join(parts)


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        raise HTTPError(400, _describe(error)) from None


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Batch:
    """The engine requests behind one HTTP request, one per prompt; their updates arrive on one queue."""

    def __init__(
        self, engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int, *, stream: bool, text: bool
    ) -> None:
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
        waiter, gone = asyncio.ensure_future(self.wait()), asyncio.ensure_future(_client_gone(request))
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


def _sse(data: BaseModel | dict[str, Any]) -> str:
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {text}\n\n"


async def _stream(
    batch: Batch, render: Callable[[int, SampleUpdate], BaseModel | None], tail: Callable[[], list[BaseModel]]
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per sample update, then `tail()` (e.g. usage), then `[DONE]`."""
    try:
        while not batch.finished:
            index, samples = await batch.next()
            for sample in samples:
                chunk = render(index, sample)
                if chunk is not None:
                    yield _sse(chunk)
        if batch.error:
            yield _sse(_error_body(500, batch.error, "server_error"))
            return
        for chunk in tail():
            yield _sse(chunk)
        yield "data: [DONE]\n\n"
    finally:
        batch.cancel()


class QueueDepthHeader:
    """Adds `x-queue-depth` (requests waiting in the engine) to every response; the eval client's concurrency
    control reads it."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                depth = str(self.engine.gauges.waiting_requests).encode()
                message["headers"] = [*message.get("headers", []), (QUEUE_DEPTH_HEADER.encode(), depth)]
            await send(message)

        await self.app(scope, receive, with_header)


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
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.admin_token, self.weights_dir = admin_token, weights_dir
        self.created = int(time.time())
        self._weights_lock = asyncio.Lock()
        self.broadcast = BroadcastEndpoint(engine)  # the trainer's weight broadcast (weights_broadcast.py)

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/update_weights", self._admin(self.update_weights), methods=["POST"]),
            Route("/pause", self._admin(self.pause), methods=["POST"]),
            Route("/resume", self._admin(self.resume), methods=["POST"]),
            Route("/weights/broadcast/join", self._admin(self.broadcast.join_route), methods=["POST"]),
            Route("/weights/broadcast", self.broadcast.status_route, methods=["GET"]),
        ]
        handlers = {HTTPError: self._http_error, Exception: self._server_error}
        return QueueDepthHeader(Starlette(routes=routes, exception_handlers=handlers), self.engine)  # type: ignore[arg-type]

    # --- errors, auth, shared checks ---

    async def _http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPError)
        return JSONResponse(_error_body(error.status, error.message, error.kind, error.param), status_code=error.status)

    async def _server_error(self, request: Request, error: Exception) -> Response:
        logger.exception("%s %s failed", request.method, request.url.path, exc_info=error)
        return JSONResponse(_error_body(500, f"{type(error).__name__}: {error}", "server_error"), status_code=500)

    def _admin(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def checked(request: Request) -> Response:
            if self.admin_token is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
                    raise HTTPError(
                        401, "admin routes need `Authorization: Bearer <admin token>`", "authentication_error"
                    )
            return await handler(request)

        return checked

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise HTTPError(
                404,
                f"model `{name}` is not served here; this server serves `{self.model_name}`",
                "not_found_error",
                "model",
            )

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
        return _json(status, 200 if status.status == "ok" else 503)

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
        return _json(ModelList(data=[card]))

    async def generate(self, request: Request) -> Response:
        body = await _parse(request, GenerateRequest)
        self._check_model(body.model)
        params = body.sampling
        batch = Batch(self.engine, body.prompts, params, body.n, stream=False, text=False)
        if not await batch.finish_unless_gone(request):
            return Response(status_code=CLIENT_GONE)
        outputs = [
            PromptOutput(
                prompt_token_count=len(prompt),
                samples=[s.to_output(with_masks=params.truncates, with_top=params.top_logprobs > 0) for s in c.samples],
            )
            for prompt, c in zip(batch.prompts, batch.collectors, strict=True)
        ]
        response = GenerateResponse(
            id=f"gen-{uuid.uuid4().hex}", model=self.model_name, policy_version=self.engine.version, outputs=outputs
        )
        return _json(response)

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        try:
            prompts = openai_api.completion_prompts(body, self.tokenizer)
            params = openai_api.completion_sampling(body)
        except ValidationError as error:
            raise HTTPError(400, _describe(error)) from None
        except openai_api.RequestError as error:
            raise HTTPError(400, str(error)) from None
        batch = Batch(self.engine, prompts, params, body.n, stream=body.stream, text=True)
        response_id, want_logprobs = f"cmpl-{uuid.uuid4().hex}", body.logprobs is not None

        def logprobs(token_ids: list[int], lps: list[float], top: list, offset: int) -> Any:
            if not want_logprobs:
                return None
            return openai_api.completion_logprobs(self.tokenizer, token_ids, lps, top, body.logprobs or 0, offset)

        def response(choices: list[CompletionChoice], usage: Any = None) -> CompletionResponse:
            return CompletionResponse(
                id=response_id, created=int(time.time()), model=self.model_name, choices=choices, usage=usage
            )

        def usage() -> Any:
            completions = [len(s.token_ids) for c in batch.collectors for s in c.samples]
            return openai_api.usage([len(p) for p in prompts], completions)

        if body.stream:
            text_length: dict[int, int] = {}

            def render(index: int, sample: SampleUpdate) -> BaseModel | None:
                choice = index * body.n + sample.sample
                offset = text_length.get(choice, 0)
                text_length[choice] = offset + len(sample.text)
                if not (sample.text or sample.finish_reason or want_logprobs):
                    return None
                token_ids = sample.token_ids if body.return_token_ids else None
                lp = logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs, offset)
                return response(
                    [
                        CompletionChoice(
                            index=choice,
                            text=sample.text,
                            logprobs=lp,
                            finish_reason=sample.finish_reason,
                            stop_reason=sample.stop_reason,
                            token_ids=token_ids,
                        )
                    ]
                )

            with_usage = body.stream_options is not None and body.stream_options.include_usage
            tail = lambda: [response([], usage())] if with_usage else []  # noqa: E731
            return StreamingResponse(_stream(batch, render, tail), media_type="text/event-stream")
        if not await batch.finish_unless_gone(request):
            return Response(status_code=CLIENT_GONE)
        choices = [
            CompletionChoice(
                index=index * body.n + s,
                text=record.text,
                logprobs=logprobs(record.token_ids, record.logprobs, record.top_logprobs, 0),
                finish_reason=record.finish_reason or "abort",
                stop_reason=record.stop_reason,
                token_ids=record.token_ids if body.return_token_ids else None,
            )
            for index, collector in enumerate(batch.collectors)
            for s, record in enumerate(collector.samples)
        ]
        return _json(response(choices, usage()))

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        try:
            prompt = openai_api.chat_prompt(body, self.tokenizer)
            params = openai_api.chat_sampling(body)
        except ValidationError as error:
            raise HTTPError(400, _describe(error)) from None
        except openai_api.RequestError as error:
            raise HTTPError(400, str(error)) from None
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

            def render(index: int, sample: SampleUpdate) -> BaseModel | None:
                if not (sample.text or sample.finish_reason or body.logprobs):
                    return None
                choice = ChatChunkChoice(
                    index=sample.sample,
                    delta=ChatDelta(content=sample.text),
                    logprobs=logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs),
                    finish_reason=sample.finish_reason,
                    token_ids=sample.token_ids if body.return_token_ids else None,
                )
                return chunk([choice])

            async def events() -> AsyncIterator[str]:
                for i in range(body.n):
                    yield _sse(chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
                with_usage = body.stream_options is not None and body.stream_options.include_usage
                async for event in _stream(batch, render, lambda: [chunk([], usage())] if with_usage else []):
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream")
        if not await batch.finish_unless_gone(request):
            return Response(status_code=CLIENT_GONE)
        choices = [
            ChatChoice(
                index=s,
                message=AssistantMessage(content=record.text),
                logprobs=logprobs(record.token_ids, record.logprobs, record.top_logprobs),
                finish_reason=record.finish_reason or "abort",
                stop_reason=record.stop_reason,
                token_ids=record.token_ids if body.return_token_ids else None,
            )
            for s, record in enumerate(batch.collectors[0].samples)
        ]
        response = ChatCompletionResponse(
            id=response_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage(),
            prompt_token_ids=prompt if body.return_token_ids else None,
        )
        return _json(response)

    async def update_weights(self, request: Request) -> Response:
        body = await _parse(request, UpdateWeightsRequest)
        async with self._weights_lock:
            if body.version < self.engine.version:  # a late or duplicated update must not roll the policy back
                raise HTTPError(
                    409,
                    f"policy version {body.version} is older than the served version {self.engine.version}; "
                    "versions never go backwards (restart the server to serve an older policy)",
                    param="version",
                )
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
        return _json(UpdateWeightsResponse(policy_version=self.engine.version, load_s=load_s, pause_s=pause_s))

    async def pause(self, request: Request) -> Response:
        await asyncio.wrap_future(self.engine.pause())
        return _json(self._status())

    async def resume(self, request: Request) -> Response:
        await asyncio.wrap_future(self.engine.resume())
        return _json(self._status())
