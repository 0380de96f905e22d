"""The inference servers as the orchestrator sees them: token-in generation, least-loaded choice, idle time.

Any server that speaks the built-in engine's `/generate` contract works (docs/inference.md), so the built-in
engine and vLLM look the same from here. Rollouts go as msgpack both ways: a group's token ids, logprobs and
versions are far cheaper to encode, parse and validate than as JSON (benchmarks/RESULTS.md). Weight updates
are the followers' of `tandem.transport.weights`, which set `version` and `loaded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.client import OpenAIClient, RequestError
from tandem.config.orchestrator import MAX_REPLAY_KEPT, InferencePoolConfig
from tandem.net import admin_token
from tandem.wire.kept_ids import count_kept_ids, decode_kept_ids
from tandem.wire.protocol import GenerateRequest, GenerateResponse, SampleOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    # Per token, the ids sampling kept ([]: the whole vocabulary; None: more than MAX_REPLAY_KEPT, not listed);
    # None when no token was truncated.
    kept_ids: list[list[int] | None] | None
    # Per token, whether the engine generated it (a loss target); False on the environment's answers between the
    # turns of a multi-turn rollout. None: every token was generated.
    trained: list[bool] | None = None


class InferencePool:
    def __init__(self, config: InferencePoolConfig):
        self.config = config
        self.admin_token = admin_token(config.admin_token)
        self.clients = [
            OpenAIClient(url, api_key=self.admin_token, timeout_s=config.request_timeout_s) for url in config.base_urls
        ]
        self.in_flight = [0] * len(self.clients)
        self.requests = [0] * len(self.clients)  # rollout requests sent to each server
        self.version = 0
        self.loaded = False
        """Whether this process has loaded a policy yet (its first load may roll the servers back)."""
        self.idle_s = 0.0
        self._idle_from = time.monotonic()

    async def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        for url, client in zip(self.config.base_urls, self.clients, strict=True):
            while True:
                try:
                    await client.request("GET", "/health")
                    break
                except RequestError as error:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"inference server {url} not healthy: {error}") from None
                    await asyncio.sleep(0.5)

    @contextlib.contextmanager
    def _busy(self, index: int) -> Iterator[None]:
        """Count a request in flight on server `index`; time with nothing in flight adds to `idle_s`."""
        if not any(self.in_flight):
            self.idle_s += time.monotonic() - self._idle_from
        self.in_flight[index] += 1
        try:
            yield
        finally:
            self.in_flight[index] -= 1
            if not any(self.in_flight):
                self._idle_from = time.monotonic()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[Completion]:
        """n completions of one prompt from the least-loaded server."""
        return (await self.generate_with_images(prompt_ids, [], params, n))[2]

    async def generate_with_images(
        self, prompt_ids: list[int], images: list[str], params: SamplingParams, n: int
    ) -> tuple[list[int], list[tuple[int, int]], list[Completion]]:
        """n completions of one prompt with `images` (data URLs, one placeholder each in the prompt), the prompt
        as the server ran it (each placeholder expanded to the image's tokens) and each image's span in it."""
        request = GenerateRequest(
            prompt_token_ids=prompt_ids, images=[images] if images else None, n=n, sampling=params
        )
        output = (await self.generate_response(request)).outputs[0]
        completions = [to_completion(sample) for sample in output.samples]
        return output.prompt_token_ids or prompt_ids, list(output.image_spans or ()), completions

    async def generate_response(self, request: GenerateRequest) -> GenerateResponse:
        """`request` answered by the least-loaded server."""
        index = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        self.requests[index] += 1
        with self._busy(index):
            body = request.model_dump(exclude_none=True)
            reply = await self.clients[index].request("POST", "/generate", body, msgpack=True)
        # msgpack decodes to plain lists and numbers; the model checks every field the trainer relies on
        return GenerateResponse.model_validate(reply.data)

    async def close(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


def to_completion(sample: SampleOutput) -> Completion:
    encoded = sample.masks  # the wire's name for the encoded kept ids
    kept_ids = None
    if encoded is not None and any(e is not None for e in encoded):  # else no token was truncated
        kept_ids = [_replayable_kept_ids(e) for e in encoded]
    return Completion(sample.token_ids, sample.logprobs, sample.versions, sample.finish_reason, kept_ids)


def _replayable_kept_ids(encoded: str | None) -> list[int] | None:
    """One token's kept ids ([]: the whole vocabulary); None for more than the trainer replays, never listed."""
    if not encoded:
        return []
    return None if count_kept_ids(encoded) > MAX_REPLAY_KEPT else decode_kept_ids(encoded)
