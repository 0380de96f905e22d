"""How many requests to keep in flight: additive increase, multiplicative decrease (AIMD), as TCP does.

Start at `initial`; after a window of successes (one per request in flight)
whose mean latency stays within `latency_tolerance` of the best window seen,
add `increase`. Shrink by `decrease` on any sign of overload: a timeout, a
connection error, a 5xx, a 429, or a server queue deeper than in the last
window. Feedback from requests sent before the last change describes the old
limit, so it neither fills a window nor shrinks the limit a second time.
Nothing here knows about evals; the orchestrator drives inference the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config.eval import ConcurrencyConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Feedback:
    """What one request attempt says about the server's load."""

    started_at: float
    """`time.monotonic()` when the request was sent."""
    latency_s: float
    overload: str | None = None
    """Why the attempt counts as overload ("timeout", "connection", "5xx", "429"); None for a success."""
    queue_depth: int | None = None
    """Requests waiting on the server, when it reports it."""


class AimdController:
    """The concurrency limit, moved by `Feedback`; pure bookkeeping, no asyncio."""

    def __init__(self, config: ConcurrencyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limit = config.initial
        self._clock = clock
        self._changed_at = self._decreased_at = clock()
        self._window: list[Feedback] = []
        self._best_latency = math.inf
        self._last_queue: int | None = None

    def record(self, feedback: Feedback) -> None:
        if feedback.overload is not None:
            if feedback.started_at >= self._decreased_at:
                self._shrink(feedback.overload)
            return
        if feedback.started_at < self._changed_at:
            return
        self._window.append(feedback)
        if len(self._window) < self.limit:
            return
        latency = sum(f.latency_s for f in self._window) / len(self._window)
        depths = [f.queue_depth for f in self._window if f.queue_depth is not None]
        queue = max(depths) if depths else None
        queue_grew = queue is not None and self._last_queue is not None and queue > self._last_queue
        self._last_queue = queue
        self._best_latency = min(self._best_latency, latency)
        self._window = []
        if queue_grew:
            self._shrink(f"server queue grew to {queue}")
        elif latency <= self.config.latency_tolerance * self._best_latency:
            self._set(min(self.config.max, self.limit + self.config.increase), "latency holds")

    def _shrink(self, reason: str) -> None:
        self._decreased_at = self._clock()
        self._set(max(self.config.min, int(self.limit * self.config.decrease)), reason)

    def _set(self, limit: int, reason: str) -> None:
        self._changed_at = self._clock()
        self._window = []
        if limit != self.limit:
            log = logger.info if limit < self.limit else logger.debug
            log("concurrency %d -> %d (%s)", self.limit, limit, reason)
            self.limit = limit


class AdaptiveLimiter:
    """An asyncio semaphore whose size is the controller's current limit.

    `async with limiter:` holds one slot; `limiter.record(feedback)` moves the
    limit and wakes waiters when it grew. Shrinking never interrupts requests
    already in flight: new ones wait until enough have finished.
    """

    def __init__(self, controller: AimdController) -> None:
        self.controller = controller
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        return self.controller.limit

    def record(self, feedback: Feedback) -> None:
        self.controller.record(feedback)
        self._wake()

    async def acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.cancelled():
                self.release()  # granted a slot just as we were cancelled: hand it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    async def __aenter__(self) -> AdaptiveLimiter:
        await self.acquire()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
