"""The orchestrator's end of the weight transports: `make_follower` builds the kind's `PolicyFollower`
(`file.FileFollower`, or `JoinedFollower` here for the in-memory `broadcast` and `shared`, which has every server
join the trainer's hand-off, then follows the version they serve).

The trainer pushes policies to the servers itself; the orchestrator only reads the rendezvous trainer rank 0
announces (`<run>/weights_rendezvous.json`), asks server i to join as rank i + 1 (`POST /weights/join`), and
polls `GET /weights`: `pool.version` is the oldest version any server serves, and a server whose receiving end
failed fails the run with its error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from tandem.transport.weights.base import PolicyFollower, Transport
from tandem.transport.weights.control import (
    JoinRequest,
    Kind,
    ReceiverStatus,
    Rendezvous,
    WeightTransportError,
    announce_path,
)
from tandem.transport.weights.file import FileFollower

logger = logging.getLogger(__name__)


def make_follower(transport: Transport, pool: Any, run_dir: Path, startup_timeout_s: float) -> PolicyFollower:
    """The orchestrator's follower of `transport` over `pool` (an `InferencePool`: its `clients`,
    `config.base_urls`, `version` and `loaded`)."""
    if transport == "file":
        return FileFollower(pool, run_dir)
    return JoinedFollower(transport, pool, run_dir, startup_timeout_s)


class JoinedFollower:
    def __init__(self, kind: Kind, pool: Any, run_dir: Path, startup_timeout_s: float) -> None:
        self.kind, self.pool, self.run_dir, self.startup_timeout_s = kind, pool, run_dir, startup_timeout_s

    async def rendezvous(self) -> Rendezvous:
        """The trainer's rendezvous, once trainer rank 0 has announced it."""
        path = announce_path(self.run_dir)
        deadline = time.monotonic() + self.startup_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the trainer announced no weight hand-off in {path} (is it using weights.transport = {self.kind}?)"
                )
            await asyncio.sleep(0.1)
        rendezvous = Rendezvous.model_validate_json(path.read_text())
        if rendezvous.kind != self.kind:
            raise WeightTransportError(f"the trainer hands weights over by {rendezvous.kind}, not {self.kind}")
        return rendezvous

    async def start(self) -> None:
        """Have every server join the trainer's hand-off; returns once all have."""
        rendezvous = await self.rendezvous()
        clients = self.pool.clients
        world_size = len(clients) + 1
        for rank, client in enumerate(clients, start=1):
            join = JoinRequest(**rendezvous.model_dump(), rank=rank, world_size=world_size)
            await client.request("POST", "/weights/join", join.model_dump())
        deadline = time.monotonic() + rendezvous.timeout_s
        while any(status.state == "joining" for status in await self.statuses()):
            if time.monotonic() > deadline:
                raise WeightTransportError(
                    f"the inference servers did not join the weight {self.kind} in {rendezvous.timeout_s:g}s"
                )
            await asyncio.sleep(0.1)
        logger.info("%d inference servers joined the trainer's weight %s", len(clients), self.kind)

    async def statuses(self) -> list[ReceiverStatus]:
        """Each server's receiving end; raises if one failed."""
        pool = self.pool
        replies = await asyncio.gather(*(client.request("GET", "/weights") for client in pool.clients))
        statuses = [ReceiverStatus.model_validate(reply.data) for reply in replies]
        for url, status in zip(pool.config.base_urls, statuses, strict=True):
            if status.state == "failed":
                raise WeightTransportError(f"inference server {url}: {status.error}")
        return statuses

    async def poll(self) -> None:
        version = min(status.policy_version for status in await self.statuses())
        if version > self.pool.version:
            self.pool.version, self.pool.loaded = version, True
            logger.info("inference now serves policy %d", version)
