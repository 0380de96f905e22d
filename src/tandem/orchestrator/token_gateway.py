"""The token route verifiers' harnesses sample through in training: `/s<i>/inference/v1/generate` and
`/s<i>/v1/models` on a loopback port of the orchestrator, one prefix per source.

verifiers' train client renders each prompt with `renderers` and posts it to `{base_url}/inference/v1/generate`
(the route `tandem.wire.token_generate` describes); it reads `max_model_len` from `{base_url}/models` first.
Pointing that base URL here rather than at one inference server lets the orchestrator give a training sample
what it needs:

- calls are spread over the inference pool by load, as native rollouts are;
- each call samples with its source's settings (temperature, top-p, top-k, min-p), whatever the harness asks,
  since the trainer recomputes the logprobs at exactly those; the harness keeps its stop ids and token budget,
  capped so that the prompt and reply fit seq_len (which `/models` reports as the context);
- call t of an episode is seeded from the episode's seed and t, so an episode drawn again samples the same;
- every call's tokens are recorded with what verifiers' traces do not keep (each token's policy version and
  kept ids), under the episode's seed and the session header verifiers sends with each call (the trace id),
  for `verifiers_rollouts` to check each trained token against and take those from (`take`). Taking by
  episode also frees the calls of an attempt verifiers retried and of traces that are not trained.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tandem.client import RequestError
from tandem.config.orchestrator import RolloutSamplingConfig
from tandem.orchestrator.pool import Completion, InferencePool, to_completion
from tandem.wire.protocol import ModelCard, ModelList, context_room
from tandem.wire.token_generate import TokenGenerateRequest, token_response

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"
"""The header verifiers' train client sends with each model call: the id of the trace it belongs to."""
TURN_SEED_STRIDE = 104729


def _error(status: int, message: str) -> JSONResponse:
    """A refusal in the servers' (OpenAI's) error shape, which verifiers hands the harness as a provider error."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


@dataclass(frozen=True)
class Call:
    """One model call of an episode as the engine ran it."""

    prompt_ids: list[int]
    completion: Completion


class TokenGateway:
    """The route over `pool` for `sources` (each one's sampling settings, by position), served while started."""

    def __init__(
        self, pool: InferencePool, sources: Sequence[RolloutSamplingConfig], *, model_name: str, seq_len: int
    ) -> None:
        self.pool, self.sources, self.model_name, self.seq_len = pool, list(sources), model_name, seq_len
        self.calls: defaultdict[int, defaultdict[str, list[Call]]] = defaultdict(lambda: defaultdict(list))
        """Episode seed -> session (trace id) -> its calls, in order."""
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task | None = None
        self.url = ""

    def base_url(self, source: int) -> str:
        """The OpenAI-style base URL (ending in /v1) the harnesses of source `source` sample through."""
        return f"{self.url}/s{source}/v1"

    def take(self, episode_seed: int) -> dict[str, list[Call]]:
        """The calls of one episode by session (trace id), each session's in order, forgotten here."""
        return dict(self.calls.pop(episode_seed, {}))

    async def start(self) -> None:
        app = Starlette(
            routes=[
                Route("/s{source:int}/v1/models", self.models, methods=["GET"]),
                Route("/s{source:int}/inference/v1/generate", self.generate, methods=["POST"]),
            ]
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, lifespan="off", access_log=False, timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # the server failed to start: raise why
            await asyncio.sleep(0.01)
        logger.info("verifiers harnesses sample through %s", self.url)

    async def stop(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving

    def _source(self, request: Request) -> RolloutSamplingConfig | None:
        index = request.path_params["source"]
        return self.sources[index] if 0 <= index < len(self.sources) else None

    async def models(self, request: Request) -> Response:
        if self._source(request) is None:
            return _error(404, f"no source {request.path_params['source']}")
        return JSONResponse(
            ModelList(data=[ModelCard(id=self.model_name, created=0, max_model_len=self.seq_len)]).model_dump()
        )

    async def generate(self, request: Request) -> Response:
        source = self._source(request)
        if source is None:
            return _error(404, f"no source {request.path_params['source']}")
        try:
            body = TokenGenerateRequest.model_validate_json(await request.body())
            room = context_room(len(body.token_ids), None, self.seq_len)
            generate = body.generate_request()
        except ValueError as error:  # pydantic's ValidationError included
            return _error(400, str(error))
        session = request.headers.get(SESSION_HEADER)
        asked = body.sampling_params
        if not session or asked.seed is None:
            return _error(400, f"calls are recorded by episode seed and {SESSION_HEADER}; one is missing")
        calls = self.calls[asked.seed][session]
        params = generate.sampling.model_copy(
            update={
                "temperature": source.temperature,
                "top_p": source.top_p,
                "top_k": source.top_k,
                "min_p": source.min_p,
                "max_tokens": min(asked.max_tokens or source.max_tokens, room),
                "seed": (asked.seed + TURN_SEED_STRIDE * len(calls)) % 2**63,
            }
        )
        update = {"sampling": params, "n": 1, "model": None}  # the servers' own model
        try:
            response = await self.pool.generate_response(generate.model_copy(update=update))
        except RequestError as error:
            return _error(error.status or 502, str(error))
        (sample,) = response.outputs[0].samples
        calls.append(Call(body.token_ids, to_completion(sample)))
        return JSONResponse(token_response(body, response, vocab_size=None).model_dump())
