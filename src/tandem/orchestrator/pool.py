"""The inference servers as the orchestrator sees them: token-in generation, least-loaded choice, weight updates.

Any server that speaks the built-in engine's `/generate`, `/update_weights`, `/pause` and `/resume`
contract works (docs/inference.md), so the built-in engine and vLLM look the same from here. Rollouts go as
msgpack both ways (16 samples x 256 ids, logprobs and versions cost a fifth of the JSON's encode and parse).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config.orchestrator import MAX_REPLAY_KEPT, InferencePoolConfig, RolloutSamplingConfig
from tandem.eval.client import OpenAIClient, RequestError
from tandem.inference.masks import decode_mask, mask_size
from tandem.inference.protocol import GenerateRequest, GenerateResponse, SampleOutput, SamplingParams
from tandem.transport.broadcast import JoinRequest, ReceiverStatus, Rendezvous, WeightBroadcastError

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


class InferencePool:
    def __init__(self, config: InferencePoolConfig):
        self.config = config
        self.clients = [
            OpenAIClient(url, api_key=config.admin_token, timeout_s=config.request_timeout_s)
            for url in config.base_urls
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

    async def generate(
        self, prompt_ids: list[int], sampling: RolloutSamplingConfig, n: int, seed: int
    ) -> list[Completion]:
        """n completions of one prompt from the least-loaded server."""
        index = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        request = GenerateRequest(
            prompt_token_ids=prompt_ids,
            n=n,
            sampling=SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                max_tokens=sampling.max_tokens,
                ignore_eos=sampling.ignore_eos,
                seed=seed,
            ),
        )
        self.requests[index] += 1
        with self._busy(index):
            body = request.model_dump(exclude_none=True)
            reply = await self.clients[index].request("POST", "/generate", body, msgpack=True)
        # msgpack decodes to plain lists and numbers; the model checks every field the trainer relies on
        response = GenerateResponse.model_validate(reply.data)
        return [_completion(sample) for sample in response.outputs[0].samples]

    async def load_policy(self, path: Path, version: int) -> None:
        """Pause every server, swap in policy `version`, resume: requests in flight continue with it.

        The first load may roll the servers back: long-lived servers may serve a later policy than the one a
        resumed run continues from."""
        body: dict[str, Any] = {"path": str(path), "version": version, "rollback": not self.loaded}
        await asyncio.gather(*(client.request("POST", "/pause") for client in self.clients))
        try:
            await asyncio.gather(*(client.request("POST", "/update_weights", body) for client in self.clients))
        finally:
            await asyncio.gather(*(client.request("POST", "/resume") for client in self.clients))
        self.version, self.loaded = version, True
        logger.info("inference now serves policy %d", version)

    async def join_broadcast(self, rendezvous: Rendezvous) -> None:
        """Have every server join the trainer's weight broadcast (server i is rank i + 1); returns once all have."""
        world_size = len(self.clients) + 1
        for rank, client in enumerate(self.clients, start=1):
            join = JoinRequest(**rendezvous.model_dump(), rank=rank, world_size=world_size)
            await client.request("POST", "/weights/broadcast/join", join.model_dump())
        deadline = time.monotonic() + rendezvous.timeout_s
        while any(status.state == "joining" for status in await self.follow_broadcast()):
            if time.monotonic() > deadline:
                raise WeightBroadcastError(
                    f"the inference servers did not join the weight broadcast in {rendezvous.timeout_s:g}s"
                )
            await asyncio.sleep(0.1)
        logger.info("%d inference servers joined the trainer's weight broadcast", len(self.clients))

    async def follow_broadcast(self) -> list[ReceiverStatus]:
        """Each server's broadcast status; `version` becomes the policy all of them serve. Raises if one failed."""
        replies = await asyncio.gather(*(client.request("GET", "/weights/broadcast") for client in self.clients))
        statuses = [ReceiverStatus.model_validate(reply.data) for reply in replies]
        for url, status in zip(self.config.base_urls, statuses, strict=True):
            if status.state == "failed":
                raise WeightBroadcastError(f"inference server {url}: {status.error}")
        version = min(status.policy_version for status in statuses)
        if version > self.version:
            self.version = version
            logger.info("inference now serves policy %d", version)
        return statuses

    async def close(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


def _completion(sample: SampleOutput) -> Completion:
    masks = sample.masks
    kept = None if masks is None or all(m is None for m in masks) else [_kept_set(m) for m in masks]
    return Completion(sample.token_ids, sample.logprobs, sample.versions, sample.finish_reason, kept)


def _kept_set(mask: str | None) -> list[int] | None:
    """One token's kept ids; None for a set too large to replay, which is never listed."""
    if not mask:
        return []
    return None if mask_size(mask) > MAX_REPLAY_KEPT else decode_mask(mask)
