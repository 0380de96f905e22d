"""The built-in server's routes: OpenAI-compatible completions and chat, token-in `/generate`, health, metrics and
the admin routes, over one engine.

Each HTTP request becomes one engine request per prompt (`RequestGroup`), whose updates the engine thread hands to
the event loop. The routes only drive the engine and choose what runs on a worker thread: tokenizing, chat
templating and rendering a whole response's logprobs (a decode per token), so a huge prompt never holds up
`/health` or other requests. Reading, parsing and refusing requests, streaming, disconnects, the admin guard and
the `x-queue-depth` header are `http.py`'s and the OpenAI response objects `openai_api.py`'s, both shared with
the vLLM routes where they apply: a request's body is size-limited and validated strictly (`tandem.wire.protocol`), and
every mistake is a 4xx JSON error after which the server carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from tandem.inference import openai_api
from tandem.inference.client_template import TemplateRefused, check_template_kwargs, with_deadline
from tandem.inference.engine import Engine
from tandem.inference.http import (
    DEFAULT_MAX_BODY_BYTES,
    AdminGuard,
    HTTPError,
    QueueDepthHeader,
    check_model,
    check_version_order,
    encoded_response,
    endpoint,
    json_response,
    parse,
    refusals,
    sse_response,
    unless_client_gone,
)
from tandem.inference.image_work import ImageWork, PixelBudget
from tandem.inference.outputs import Collector, RequestUpdate, SampleUpdate
from tandem.inference.prompt_images import PromptImages
from tandem.inference.prompt_tokens import ContextTokenizer
from tandem.inference.weights import read_weights, resolve_weights_path
from tandem.inference.weights_receiver import ReceiverEndpoint
from tandem.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EngineStatus,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from tandem.wire.token_generate import TOKEN_ROUTE, TokenGenerateRequest, token_response

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class RequestGroup:
    """The engine requests behind one HTTP request, one per prompt; their updates arrive on one queue."""

    def __init__(
        self,
        engine: Engine,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        *,
        stream: bool,
        text: bool,
        adapter: bool = True,
        images: list[PromptImages | None] | None = None,
    ) -> None:
        images = images or [None] * len(prompts)
        with refusals():  # every prompt, before anything is made or queued for any
            for prompt in prompts:
                engine.check(prompt, params, n=n, detokenize=text)
        loop = asyncio.get_running_loop()
        self.engine = engine
        self.updates: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()
        self.collectors = [Collector(n) for _ in prompts]
        self.ids: list[str] = []
        try:
            with refusals():
                for index, (prompt, prompt_images) in enumerate(zip(prompts, images, strict=True)):
                    deliver = partial(self._deliver, loop, index)
                    submit = partial(engine.submit, n=n, stream=stream, detokenize=text, adapter=adapter)
                    self.ids.append(submit(prompt, params, deliver, images=prompt_images))
        except HTTPError:
            self.cancel()
            raise
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

    async def _next(self) -> tuple[int, list[SampleUpdate]]:
        index, update = await self.updates.get()
        return index, self.collectors[index].add(update)

    async def _wait(self) -> None:
        while not self.finished:
            await self._next()

    def cancel(self) -> None:
        for request_id, collector in zip(self.ids, self.collectors, strict=False):
            if not collector.finished:
                self.engine.cancel(request_id)

    def _check_error(self) -> None:
        if self.error:
            raise HTTPError(500, self.error, kind="server_error")

    async def finish(self, request: Request) -> None:
        """Wait for every engine request: ClientGone (and cancelled) if the client goes away first, 500 if one
        failed."""
        try:
            await unless_client_gone(request, self._wait())
        finally:  # also when this handler is cancelled (server shutdown)
            if not self.finished:
                self.cancel()
        self._check_error()

    async def samples(self) -> AsyncIterator[tuple[int, SampleUpdate]]:
        """Each sample update as it arrives, with the index of its prompt; 500 if a request failed. Whatever has
        not finished is cancelled when the iteration ends early (the client went away)."""
        try:
            while not self.finished:
                index, samples = await self._next()
                for sample in samples:
                    yield index, sample
            self._check_error()
        finally:
            self.cancel()


class InferenceServer:
    """The routes over one engine and its tokenizer."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        *,
        base_name: str | None = None,
        admin_token: str | None,
        weights_dir: Path,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_prompt_chars: int | None = None,
        trust_request_chat_template: bool = False,
        broadcast_hosts: Sequence[str] = (),
        image_workers: int = 2,
        max_server_image_pixels: int = 200_000_000,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.base_name = base_name
        """Served beside unfolded LoRA adapters (`model_name` then names the adapter): the base model alone."""
        self.prompt_tokenizer = ContextTokenizer(tokenizer, engine.max_model_len, max_prompt_chars)
        """Tokenizes prompt text, refusing what cannot fit the context (over `max_prompt_chars` untokenized)."""
        self.weights_dir, self.max_body_bytes = weights_dir, max_body_bytes
        self.trust_request_chat_template = trust_request_chat_template
        self.admin = AdminGuard(admin_token)
        self.created = int(time.time())
        self._weights_lock = asyncio.Lock()
        # the trainer's in-memory weight hand-off (weights_receiver.py)
        self.receiver = ReceiverEndpoint(engine, broadcast_hosts)
        self.image_work = ImageWork(image_workers)
        """Requests' images are decoded here: `image_workers` at a time, stopped on `close`."""
        self.pixel_budget = PixelBudget(max_server_image_pixels)
        """Pixels requests' decoded images hold at once, until the engine lets go of them."""

    def close(self) -> None:
        """Stop the image work in flight (each job after the image in hand) and drop what is queued."""
        self.image_work.close()

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", endpoint(self.health), methods=["GET"]),
            Route("/metrics", endpoint(self.metrics), methods=["GET"]),
            Route("/v1/models", endpoint(self.models), methods=["GET"]),
            Route("/v1/completions", endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", endpoint(self.chat_completions), methods=["POST"]),
            Route("/generate", endpoint(self.generate), methods=["POST"]),
            Route(TOKEN_ROUTE, endpoint(self.token_generate), methods=["POST"]),
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

    def _check_model(self, name: str | None) -> tuple[str, bool]:
        """The model id a request asks for (default: `model_name`), and whether it runs the LoRA adapters."""
        chosen = check_model(name, self.model_name, *([self.base_name] if self.base_name else []))
        return chosen, chosen != self.base_name

    async def _with_images(
        self, prompts: list[list[int]], refs: list[list[str]] | None
    ) -> tuple[list[list[int]], list[PromptImages | None]]:
        """The prompts with their images' placeholders expanded and the images read, on the image threads
        (`ImageWork`): every image's header and the request's pixels together checked before any is decoded, then,
        once the server's `PixelBudget` has room for them, one image at a time (400 for a bad image or one over a
        limit, before any prompt is queued). The pixels stay reserved until the engine frees them."""
        if not refs or not any(refs):
            return prompts, [None] * len(prompts)
        expanded: list[list[int]] = []
        images: list[PromptImages | None] = []
        with refusals():
            pixels = await self.image_work.run(self.engine.check_images, refs)
            reservation = await self.pixel_budget.reserve(pixels)
        try:
            with refusals():
                for prompt, urls in zip(prompts, refs, strict=True):
                    if not urls:
                        expanded.append(prompt)
                        images.append(None)
                        continue
                    ids, prompt_images = await self.image_work.run(self.engine.expand_images, prompt, urls)
                    expanded.append(ids)
                    images.append(prompt_images)
        except BaseException:
            reservation.release()
            raise
        reservation.release_when_freed([i.pixel_values for i in images if i is not None and i.pixel_values is not None])
        return expanded, images

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
        names = [self.model_name, *([self.base_name] if self.base_name else [])]
        cards = [ModelCard(id=name, created=self.created, max_model_len=self.engine.max_model_len) for name in names]
        return json_response(ModelList(data=cards))

    async def generate(self, request: Request) -> Response:
        """Token ids in, token ids, logprobs and kept ids (the `masks` field) out; in JSON or msgpack
        (`Content-Type`, `Accept`)."""
        body = await parse(request, GenerateRequest, self.max_body_bytes, msgpack=True)
        return encoded_response(request, await self._generate(request, body))

    async def token_generate(self, request: Request) -> Response:
        """vLLM's token-in route (`tandem.wire.token_generate`), answered by the same path as `/generate`."""
        body = await self._parse(request, TokenGenerateRequest)
        with refusals():
            generate_body = body.generate_request()
        response = await self._generate(request, generate_body)
        return json_response(token_response(body, response, vocab_size=self.engine.vocab_size))

    async def _generate(self, request: Request, body: GenerateRequest) -> GenerateResponse:
        name, adapter = self._check_model(body.model)
        params = body.sampling
        prompts, images = await self._with_images(body.prompts, body.images)
        group = RequestGroup(
            self.engine, prompts, params, body.n, stream=False, text=False, adapter=adapter, images=images
        )
        await group.finish(request)
        outputs = [c.to_output(len(p), params) for p, c in zip(prompts, group.collectors, strict=True)]
        for output, prompt, prompt_images in zip(outputs, prompts, images, strict=True):
            if prompt_images is not None:
                output.prompt_token_ids, output.image_spans = prompt, prompt_images.spans
        return GenerateResponse(model=name, policy_version=self.engine.version, outputs=outputs)

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        name, adapter = self._check_model(body.model)
        with refusals():
            prompts = await asyncio.to_thread(openai_api.completion_prompts, body, self.prompt_tokenizer)
            params = openai_api.completion_sampling(body)
        echoed: list[str] = []  # decoding a long prompt takes a while: off the loop, as tokenizing it was
        if body.echo:
            echoed = await asyncio.to_thread(openai_api.echo_texts, body, prompts, self.tokenizer)
        group = RequestGroup(self.engine, prompts, params, body.n, stream=body.stream, text=True, adapter=adapter)
        reply = openai_api.CompletionReply(body, self.tokenizer, name, prompts, echoed)

        async def score_echoes(indices: list[int]) -> None:
            if unscored := reply.unscored(indices):
                await asyncio.to_thread(reply.score_echoes, group.collectors, unscored)

        if body.stream:

            async def chunks() -> AsyncIterator[BaseModel]:
                async with contextlib.aclosing(group.samples()) as samples:
                    async for index, sample in samples:
                        await score_echoes([index])
                        if (chunk := reply.chunk(index, sample)) is not None:
                            yield chunk
                for chunk in reply.tail(group.collectors):
                    yield chunk

            return sse_response(chunks())
        await group.finish(request)
        await score_echoes(list(range(len(prompts))))
        whole = partial(reply.whole, group.collectors)
        return json_response(await asyncio.to_thread(whole) if reply.logprobs else whole())

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        name, adapter = self._check_model(body.model)
        with refusals():
            tools = openai_api.chat_tools(body.tools, body.tool_choice, self.prompt_tokenizer)
            prompt = await self._chat_prompt(body, tools and tools[0])
            params = openai_api.chat_sampling(body)
        urls = [url for message in body.messages for url in message.image_urls]
        (prompt,), images = await self._with_images([prompt], [urls])
        group = RequestGroup(
            self.engine, [prompt], params, body.n, stream=body.stream, text=True, adapter=adapter, images=images
        )
        reply = openai_api.ChatReply(body, self.tokenizer, name, prompt, tools and tools[1])
        if body.stream:

            async def chunks() -> AsyncIterator[BaseModel]:
                for chunk in reply.opening():
                    yield chunk
                async with contextlib.aclosing(group.samples()) as samples:
                    async for _, sample in samples:
                        render = partial(reply.chunk, sample)  # a choice's last chunk parses its tool calls
                        chunk = await asyncio.to_thread(render) if reply.parses(sample) else render()
                        if chunk is not None:
                            yield chunk
                for chunk in reply.tail(group.collectors[0]):
                    yield chunk

            return sse_response(chunks())
        await group.finish(request)
        whole = partial(reply.whole, group.collectors[0])  # off the loop, as above; so is parsing tool calls
        return json_response(await asyncio.to_thread(whole) if body.logprobs or reply.parser else whole())

    async def update_weights(self, request: Request) -> Response:
        body = await self._parse(request, UpdateWeightsRequest)
        async with self._weights_lock:
            check_version_order(body.version, self.engine.version, body.rollback)
            started = time.monotonic()
            with refusals():
                path = resolve_weights_path(body.path, self.weights_dir)
                tensors = await asyncio.to_thread(read_weights, path, self.engine.model)
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
