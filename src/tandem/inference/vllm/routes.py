"""tandem's routes on a vLLM server: an ASGI middleware in front of vLLM's FastAPI app (vLLM's `--middleware`).

It answers `POST /generate` (JSON or msgpack), `/update_weights`, `/pause`, `/resume` and `GET /health` with the
request and response bodies of the built-in server (`tandem.wire.protocol`) and, through the same plumbing
(`tandem.inference.http`), its errors, body-size limit, admin guard, model check and disconnect handling, plus its
request checks (`limits.check_prompt`) and weights-directory restriction, so the orchestrator cannot tell the
engines apart; every other request goes on to vLLM. Every response, vLLM's own included, carries `x-queue-depth`.
The engine is vLLM's `EngineClient` (`app.state.engine_client`):

- `/generate` runs one vLLM request per prompt (`n` samples each), with logprobs of the sampled tokens as vLLM
  computes them after temperature and truncation (`--logprobs-mode processed_logprobs`) and per-token policy
  versions from vLLM's weight-version spans. vLLM returns no kept ids, so `masks` is always null, and a
  request that truncates sampling (top-k, top-p, min-p) is refused unless the server was started with
  `exact_replay = false`.
- `/pause` freezes vLLM's scheduler with requests kept (`pause_generation(mode="keep")`), `/resume` restarts it.
- With a LoRA adapter (launch.py `served_adapter`), the adapter and the base model are served side by side: a
  request naming the adapter (the default) runs with vLLM's current `LoRARequest` for it, one naming the base
  without; `/update_weights` then takes a PEFT adapter directory of the served shape and replaces the adapter in
  place through vLLM's runtime LoRA loading (`load_lora_adapter(load_inplace=True)`, which its OpenAI routes
  read too).
- `/update_weights` checks the checkpoint like the built-in server (same architecture and tensor shapes as the
  served model, inside `weights_dir`: `weights.check_checkpoint`), then, with generation held, has every worker
  load it in place
  (worker.py), drops the KV cache computed with the old weights (requests in flight are recomputed from their
  tokens) and labels what follows with the new version.

vLLM constructs middleware without arguments, so the settings come from `$TANDEM_VLLM_ROUTES` (JSON, written by
launch.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.inference.http import (
    AdminGuard,
    HTTPError,
    answer,
    check_model,
    check_version_order,
    encoded_response,
    json_response,
    parse,
    refusals,
    unless_client_gone,
    with_queue_depth,
)
from tandem.inference.limits import ServerLimits, check_prompt
from tandem.inference.startup import announce
from tandem.inference.weights import (
    Shapes,
    WeightsError,
    check_checkpoint,
    checkpoint_shapes,
    read_served_adapter,
    resolve_weights_path,
)
from tandem.models import ModelArgs, model_args
from tandem.models.lora import LoraArgs, read_adapter
from tandem.transport.weights.control import check_same_model
from tandem.wire.protocol import (
    EngineStatus,
    GenerateRequest,
    GenerateResponse,
    PromptOutput,
    SampleOutput,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from tandem.wire.token_generate import TOKEN_ROUTE, TokenGenerateRequest, token_response

logger = logging.getLogger(__name__)

SETTINGS_ENV = "TANDEM_VLLM_ROUTES"
FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class RouteSettings:
    model_dir: str
    model_name: str
    weights_dir: str
    admin_token: str | None
    exact_replay: bool
    run_dir: str
    """Where `server.json` is written once the server listens."""
    max_body_bytes: int
    base_name: str | None = None
    """With a LoRA adapter (`model_name` then names it): the base model's id, served beside it."""
    lora_path: str | None = None
    """The adapter vLLM started with (its shape is what `/update_weights` must offer)."""

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> RouteSettings:
        if SETTINGS_ENV not in os.environ:
            raise RuntimeError(f"${SETTINGS_ENV} is not set: start this server with `tandem inference --engine vllm`")
        return cls(**json.loads(os.environ[SETTINGS_ENV]))


Handler = Callable[[Request, Any], Awaitable[Response]]


@dataclasses.dataclass(frozen=True)
class PromptSettings:
    """What the token route says about a prompt beyond its sampling, for vLLM's scheduler and prefix cache."""

    cache_salt: str | None = None
    """Prefix-cache entries are shared only between prompts of the same salt (verifiers salts by policy)."""
    priority: int = 0
    """vLLM's scheduling priority (refused by vLLM unless it runs its priority scheduler)."""


class TandemRoutes:
    """The middleware: tandem's routes, then vLLM's app for everything else."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.settings = RouteSettings.from_env()
        admin = AdminGuard(self.settings.admin_token)
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", "/generate"): self.generate,
            ("POST", TOKEN_ROUTE): self.token_generate,
            ("GET", "/health"): self.health,
            ("POST", "/update_weights"): admin(self.update_weights),
            ("POST", "/pause"): admin(self.pause),
            ("POST", "/resume"): admin(self.resume),
        }
        self.error: str | None = None  # set when a weight update failed part-way
        self._weights_lock: asyncio.Lock | None = None
        self._served: tuple[ModelArgs, Shapes] | None = None
        self._served_adapter: tuple[LoraArgs, Shapes] | None = None
        self._announcing: asyncio.Task | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._on_startup(scope, send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        engine = getattr(scope["app"].state, "engine_client", None)  # set once vLLM's start-up has made it
        send = with_queue_depth(send, lambda: _waiting(engine))
        handler = self.routes.get((scope.get("method", ""), scope.get("path", "")))
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        response = await answer(request, handler(request, engine))
        await response(scope, receive, send)

    # --- start-up: version 0, then server.json once the server listens ---

    def _on_startup(self, scope: Scope, send: Send) -> Send:
        async def forward(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                app = scope["app"]
                engine = app.state.engine_client
                if _version_number(await engine.get_weight_version()) is None:
                    await engine.update_weight_version("0")  # vLLM starts as "default"; tandem's first policy is 0
                self._announcing = asyncio.ensure_future(self._announce(app))
            await send(message)

        return forward

    async def _announce(self, app: Any) -> None:
        while not getattr(getattr(app.state, "server", None), "started", False):
            await asyncio.sleep(0.05)
        announce(Path(self.settings.run_dir), app.state.server.servers[0].sockets[0], self.settings.model_name)

    # --- shared state ---

    async def _version(self, engine: Any) -> int:
        return _version_number(await engine.get_weight_version()) or 0

    async def _status(self, engine: Any) -> EngineStatus:
        try:
            await engine.check_health()
        except Exception as failure:
            error = f"the vLLM engine is not running: {type(failure).__name__}: {failure}"
            return EngineStatus(status="error", paused=False, policy_version=0, error=error)
        paused, version = await engine.is_paused(), await self._version(engine)
        return EngineStatus(
            status="error" if self.error else "ok", paused=paused, policy_version=version, error=self.error
        )

    # --- routes ---

    async def health(self, request: Request, engine: Any) -> Response:
        status = await self._status(engine)
        return json_response(status, 200 if status.status == "ok" else 503)

    async def pause(self, request: Request, engine: Any) -> Response:
        await engine.pause_generation(mode="keep", clear_cache=False)
        return json_response(await self._status(engine))

    async def resume(self, request: Request, engine: Any) -> Response:
        await engine.resume_generation()
        return json_response(await self._status(engine))

    async def generate(self, request: Request, engine: Any) -> Response:
        body = await parse(request, GenerateRequest, self.settings.max_body_bytes, msgpack=True)
        return encoded_response(request, await self._generate(request, engine, body))

    async def token_generate(self, request: Request, engine: Any) -> Response:
        """vLLM's token-in route in the shape `renderers` parses (`tandem.wire.token_generate`), answered by the
        same path as `/generate`; vLLM's own answer (integer-id logprobs) is one `renderers` refuses."""
        body = await parse(request, TokenGenerateRequest, self.settings.max_body_bytes)
        with refusals():
            generate_body = body.generate_request()
        prompt = PromptSettings(cache_salt=body.cache_salt, priority=body.priority)
        response = await self._generate(request, engine, generate_body, prompt)
        vocab_size = engine.model_config.get_vocab_size()
        return json_response(token_response(body, response, vocab_size=vocab_size))

    async def _generate(
        self, request: Request, engine: Any, body: GenerateRequest, prompt: PromptSettings | None = None
    ) -> GenerateResponse:
        base = self.settings.base_name
        name = check_model(body.model, self.settings.model_name, *([base] if base else []))
        lora_request = self._lora_request(request) if base and name != base else None
        if self.error is not None:
            raise HTTPError(503, f"not generating with partly loaded weights: {self.error}", "server_error")
        if body.images and any(body.images):
            raise HTTPError(400, "images: /generate takes images on the built-in engine only", param="images")
        params = body.sampling
        limits = self._limits(engine)
        with refusals():  # every prompt, before anything is sent to vLLM for any
            for ids in body.prompts:
                check_prompt(ids, params, limits, n=body.n)
        vllm_params = _vllm_sampling(params, body.n)
        settings = prompt or PromptSettings()
        tasks = [
            asyncio.ensure_future(self._prompt(engine, ids, vllm_params, params, settings, lora_request))
            for ids in body.prompts
        ]
        try:
            outputs = await unless_client_gone(request, asyncio.gather(*tasks))
        finally:  # also when one prompt failed: cancelling a vLLM request's generator aborts it
            for task in tasks:
                task.cancel()
        return GenerateResponse(model=name, policy_version=await self._version(engine), outputs=outputs)

    def _lora_request(self, request: Request) -> Any:
        """vLLM's current `LoRARequest` of the served adapter (replaced in place by `/update_weights`)."""
        return request.app.state.openai_serving_models.lora_requests[self.settings.model_name]

    def _limits(self, engine: Any) -> ServerLimits:
        """What this vLLM server can serve: its model's vocabulary, context and logprob cap; no kept ids (so
        truncated sampling only without `exact_replay`) and no prompt logprobs on /generate. vLLM schedules a
        request's samples itself, so the built-in engine's batch limits do not apply."""
        config = engine.model_config
        vocab_size = config.get_vocab_size()
        return ServerLimits(
            vocab_size=vocab_size,
            max_model_len=config.max_model_len,
            max_logprobs=config.max_logprobs if config.max_logprobs >= 0 else vocab_size,  # -1: vLLM's "no cap"
            text=True,
            replays_truncation=not self.settings.exact_replay,
            prompt_logprobs=False,
        )

    async def _prompt(
        self,
        engine: Any,
        prompt: list[int],
        vllm_params: Any,
        params: SamplingParams,
        settings: PromptSettings,
        lora_request: Any = None,
    ) -> PromptOutput:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.inputs import tokens_input

        final = None
        request_id = f"gen-{uuid.uuid4().hex}"
        inputs = tokens_input(prompt, cache_salt=settings.cache_salt)
        try:
            async for output in engine.generate(
                inputs, vllm_params, request_id, lora_request=lora_request, priority=settings.priority
            ):
                final = output
        except (VLLMClientError, ValueError) as error:
            raise HTTPError(400, str(error)) from None
        except GracefulHTTPError as error:
            raise HTTPError(getattr(error, "status_code", 503), str(error), "server_error") from None
        assert final is not None
        samples = [_sample(c, params) for c in sorted(final.outputs, key=lambda c: c.index)]
        return PromptOutput(prompt_token_count=len(prompt), samples=samples)

    async def update_weights(self, request: Request, engine: Any) -> Response:
        body = await parse(request, UpdateWeightsRequest, self.settings.max_body_bytes)
        self._weights_lock = self._weights_lock or asyncio.Lock()
        async with self._weights_lock:
            check_version_order(body.version, await self._version(engine), body.rollback)
            with refusals():
                path = resolve_weights_path(body.path, Path(self.settings.weights_dir))
                if self.settings.lora_path is None:
                    self._check_same_model(path)
                else:
                    self._check_same_adapter(path)
            hold = not await engine.is_paused()  # the orchestrator pauses first; a lone call pauses here
            started = time.monotonic()
            if hold:
                await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                try:
                    if self.settings.lora_path is None:
                        load_s = max(await engine.collective_rpc("tandem_load_weights", args=(str(path),)))
                    else:
                        load_s = await self._load_adapter(request, path)
                except Exception as error:
                    self.error = f"loading {path} failed part-way: {type(error).__name__}: {error}"
                    raise
                self.error = None
                # The cached keys and values were computed with the old weights: requests in flight are recomputed.
                await engine.reset_prefix_cache(reset_running_requests=True)
                await engine.update_weight_version(str(body.version))
            finally:
                if hold:
                    await engine.resume_generation()
            pause_s = time.monotonic() - started
        logger.info(
            "loaded %s as policy version %d (%.2f s, generation held %.2f s)", path, body.version, load_s, pause_s
        )
        return json_response(UpdateWeightsResponse(policy_version=body.version, load_s=load_s, pause_s=pause_s))

    async def _load_adapter(self, request: Request, path: Path) -> float:
        """Replace the served adapter in place with the one at `path` (vLLM's runtime LoRA loading, which its
        OpenAI routes use too); seconds taken."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        started = time.monotonic()
        load = LoadLoRAAdapterRequest(lora_name=self.settings.model_name, lora_path=str(path), load_inplace=True)
        result = await request.app.state.openai_serving_models.load_lora_adapter(load)
        if not isinstance(result, str):  # vLLM's ErrorResponse
            raise RuntimeError(f"vLLM did not load the adapter: {result}")
        return time.monotonic() - started

    def _check_same_adapter(self, path: Path) -> None:
        """WeightsError unless `path` is a PEFT adapter directory of the served adapter's rank, alpha, targets and
        tensor shapes, with finite values (`weights.read_served_adapter`)."""
        if self._served_adapter is None:
            assert self.settings.lora_path is not None
            args, tensors = read_adapter(self.settings.lora_path)
            self._served_adapter = (args, {key: tuple(t.shape) for key, t in tensors.items()})
        args, shapes = self._served_adapter
        offered = read_served_adapter(path, args)
        problem = check_same_model(shapes, {key: tuple(t.shape) for key, t in offered.items()}, str(path))
        if problem is not None:
            raise WeightsError(problem)

    def _check_same_model(self, path: Path) -> None:
        """WeightsError unless `path` holds the served model (ForbiddenWeightsPath for a file that links out of
        it), compared with the served directory's config.json and safetensors headers (`check_checkpoint`)."""
        if self._served is None:  # the served directory, which the user named, is trusted
            served_dir = Path(self.settings.model_dir)
            self._served = (model_args(served_dir), checkpoint_shapes(served_dir))
        check_checkpoint(path, *self._served)


def _waiting(engine: Any) -> int | None:
    """The sequences waiting in vLLM's engine, as far as this process can tell (None when it cannot): vLLM's
    engine client counts the requests it has not finished, each of n samples apart, but not which of them wait,
    and at most `max_num_seqs` of them run."""
    count = getattr(getattr(engine, "output_processor", None), "get_num_unfinished_requests", None)
    config = getattr(engine, "vllm_config", None)
    if count is None or config is None:
        return None
    return max(0, count() - config.scheduler_config.max_num_seqs)


def _version_number(label: str | None) -> int | None:
    return int(label) if label is not None and label.isdigit() else None


def _vllm_sampling(params: SamplingParams, n: int) -> Any:
    """vLLM's SamplingParams for tandem's: greedy ignores truncation, as in the built-in sampler."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy = params.greedy
    return VllmSamplingParams(
        n=n,
        temperature=params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy else max(params.top_k, 0),
        min_p=0.0 if greedy else params.min_p,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logit_bias=params.logit_bias or None,
        max_tokens=params.max_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        seed=params.seed,
        logprobs=params.top_logprobs,
        detokenize=bool(params.stop),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _sample(completion: Any, params: SamplingParams) -> SampleOutput:
    """One vLLM CompletionOutput as the built-in server's sample."""
    token_ids = list(completion.token_ids)
    steps = completion.logprobs or []
    logprobs = [float(step[token].logprob) for step, token in zip(steps, token_ids, strict=True)]
    top = None
    if params.top_logprobs:
        top = [
            [(token, float(lp.logprob)) for token, lp in sorted(step.items(), key=lambda item: item[1].rank)][
                : params.top_logprobs
            ]
            for step in steps
        ]
    versions: list[int] = []
    for span in completion.weight_versions or []:
        versions += [_version_number(span.version) or 0] * (span.end - span.start)
    stop_reason = completion.stop_reason
    if stop_reason not in (*params.stop, *params.stop_token_ids):
        stop_reason = None  # vLLM names the model's extra EOS ids here; the built-in server reports EOS as null
    finish = completion.finish_reason if completion.finish_reason in FINISH_REASONS else "abort"
    return SampleOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        masks=None,
        versions=versions,
        finish_reason=finish,
        stop_reason=stop_reason,
        top_logprobs=top,
    )
