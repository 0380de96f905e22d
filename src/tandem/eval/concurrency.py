"""How many requests to keep in flight: additive increase, multiplicative decrease (AIMD), as TCP does.

A *window* is one success per request in flight. The limit is multiplied by
`decrease` on a sign of overload: a timeout, a connection error, a 5xx or a
429, or a window whose mean latency exceeds `latency_tolerance` times the
baseline, a moving average of the windows that held. Only windows of at least
`JUDGED_WINDOW` successes are judged by latency (rollout lengths vary, so the
mean of a few is noise); smaller ones only grow the limit. After a window
without overload the limit grows: it doubles while below the slow-start
threshold and adds `increase` from it on. The threshold starts at `max` (so the
limit doubles from `initial`) and is set to where the first decrease of a run
of decreases lands, so after a burst of errors the limit doubles back to half
of what it was, then probes on slowly.

The latency rule catches fast growth: slow start overshooting what the server
runs at once, or a server that slows down. If the window after a latency
decrease is hardly faster (less than halfway to what the decrease would give
if the latency were all queueing behind our own requests), the latency was not
ours (longer tasks, a slower server): its mean becomes the baseline and the
limit grows again, instead of falling to `min` window after window. Growth as
slow as additive increase moves the baseline with it: requests queued beyond
what a server runs cost latency, not throughput, and timeouts still bound them.

A server's queue depth is no overload signal: a saturated server that batches
requests (continuous batching) always has a few waiting for the next step, and
that small standing queue is its healthy state. Feedback from requests sent
before the last change describes the old limit, so it neither fills a window
nor shrinks the limit a second time. Nothing here knows about evals; the
orchestrator's online evals use it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from tandem.client import Feedback
from tandem.config.eval import ConcurrencyConfig

logger = logging.getLogger(__name__)

JUDGED_WINDOW = 16
"""Fewest successes whose mean latency is judged against the baseline: rollout lengths vary, so the mean of
fewer is mostly noise. Smaller windows only grow the limit (it takes a few to reach this size)."""
BASELINE_WEIGHT = 0.25
"""Weight of each judged window that held in the baseline, a moving average of their mean latencies."""


class AimdController:
    """The concurrency limit, moved by `Feedback`; pure bookkeeping, no asyncio."""

    def __init__(self, config: ConcurrencyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limit = config.initial
        self.threshold = config.max
        """Slow-start threshold: below it a window doubles the limit, from it on a window adds `increase`."""
        self.baseline_s: float | None = None
        """Moving average of the judged windows' mean latencies that held (or one adopted after a decrease that
        did not help); None until the first judged window."""
        self._clock = clock
        self._changed_at = self._decreased_at = clock()
        self._window: list[Feedback] = []
        self._held = True
        """Whether a window held since the last decrease (so the next decrease starts a new run of them)."""
        self._slow_window_s: float | None = None
        """The mean latency of the window that just decreased the limit, until the next window closes."""

    def record(self, feedback: Feedback) -> None:
        if feedback.overload is not None:
            if feedback.started_at >= self._decreased_at:
                self._decrease(feedback.overload)
            return
        if feedback.started_at < self._changed_at:
            return
        self._window.append(feedback)
        if len(self._window) >= self.limit:
            size = len(self._window)
            if size < JUDGED_WINDOW:
                self._increase("a small window")
            else:
                self._judge(sum(f.latency_s for f in self._window) / size)

    def _judge(self, latency: float) -> None:
        """Move the limit by the mean latency of a full window of at least `JUDGED_WINDOW` successes."""
        slow, self._slow_window_s = self._slow_window_s, None
        if self.baseline_s is None:
            self.baseline_s = latency
        if latency <= self.config.latency_tolerance * self.baseline_s:
            self.baseline_s += BASELINE_WEIGHT * (latency - self.baseline_s)
            self._increase("latency holds")
        elif slow is not None and latency > slow * (1 + self.config.decrease) / 2:
            self.baseline_s = latency
            self._increase(f"latency {latency:.3g}s stayed at the lower limit: the new baseline")
        else:
            self._decrease(f"latency {latency:.3g}s is {latency / self.baseline_s:.1f}x the baseline")
            self._slow_window_s = latency

    def _increase(self, reason: str) -> None:
        self._held = True
        if self.limit < self.threshold:
            limit = min(self.threshold, 2 * self.limit)
        else:
            limit = min(self.config.max, self.limit + self.config.increase)
        self._set(limit, reason)

    def _decrease(self, reason: str) -> None:
        self._decreased_at = self._clock()
        self._slow_window_s = None
        limit = max(self.config.min, int(self.limit * self.config.decrease))
        if self._held:
            self.threshold, self._held = limit, False
        self._set(limit, reason)

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
        self.server_queue: int | None = None
        """The queue depth the server reported last, for display."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        return self.controller.limit

    def record(self, feedback: Feedback) -> None:
        if feedback.queue_depth is not None:
            self.server_queue = feedback.queue_depth
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
