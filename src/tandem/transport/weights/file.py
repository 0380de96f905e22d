"""The `file` weight transport: policy N is the Hugging Face directory `<run>/policies/step-N/`.

The trainer writes it whole and marks it complete last (`tandem.transport.policies`); the orchestrator sees the
newest complete one, pauses every server, has each load it (`/update_weights`) and resumes them. It needs no
more of a server than the HTTP contract, so vLLM takes it too. The orchestrator prunes the directories older
than the one every server serves, so a resumed run may find its checkpoint's policy gone: the trainer writes
it again from the checkpoint's weights. Writing the final policy prunes every older one (`publish_final`, as for
the in-memory kinds), so a finished run leaves the final policy alone.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from tandem.transport.policies import is_complete, latest_policy, policy_dir
from tandem.transport.weights.base import PolicySource, publish_final

logger = logging.getLogger(__name__)


class FilePublisher:
    """The trainer's end: every policy a directory (collective: rank 0 writes it)."""

    def __init__(self, source: PolicySource) -> None:
        self.source = source

    def publish(self, version: int) -> None:
        if version == self.source.final_version:
            publish_final(self.source)  # the policies the orchestrator did not get to prune go too
        else:
            self.source.export(version)

    def resumed(self, version: int) -> None:
        """Write checkpoint `version`'s policy again if the orchestrator pruned it: servers started afresh need it."""
        if version and not is_complete(policy_dir(self.source.run_dir / "policies", version)):
            self.source.export(version)

    def close(self) -> None:
        pass


class FileFollower:
    """The orchestrator's end: loads each newest complete policy into every server."""

    def __init__(self, pool: Any, run_dir: Path) -> None:
        self.pool = pool
        self.root = run_dir / "policies"

    async def start(self) -> None:
        pass

    async def poll(self) -> None:
        newest = latest_policy(self.root)
        if newest > self.pool.version:
            path = policy_dir(self.root, newest).resolve()
            try:
                await self.load(path, newest)
            except Exception:  # the client's RequestError (transport does not import the client)
                if is_complete(path):
                    raise
                # the trainer wrote its final policy and pruned this one while the servers read it (a refused
                # load touches nothing): the next round loads the final one
                logger.info("policy %d was pruned while loading; the newest follows", newest)

    async def load(self, path: Path, version: int) -> None:
        """Pause every server, swap in policy `version`, resume: requests in flight continue with it.

        The first load may roll the servers back: long-lived servers may serve a later policy than the one a
        resumed run continues from."""
        pool = self.pool
        body = {"path": str(path), "version": version, "rollback": not pool.loaded}
        await asyncio.gather(*(client.request("POST", "/pause") for client in pool.clients))
        try:
            await asyncio.gather(*(client.request("POST", "/update_weights", body) for client in pool.clients))
        finally:
            await asyncio.gather(*(client.request("POST", "/resume") for client in pool.clients))
        pool.version, pool.loaded = version, True
        logger.info("inference now serves policy %d", version)
