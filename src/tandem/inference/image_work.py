"""Decoding requests' images off the event loop, a bounded number at once across the server, and stoppable.

A request's images are decoded on one of `workers` threads of their own, never on the event loop nor on the
default executor the routes tokenize on, so images cannot hold up `/health`, tokenizing or each other beyond that
cap, and what decoding holds at once is bounded by `workers` images of at most `max_image_pixels`. Every job is
asked between images whether to go on: when its request is cancelled (the client went away, or the server is
shutting down and cancels its handlers) or the server closes, it ends after the image in hand, and a job still
queued never starts, so shutdown waits for at most one image per worker.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class ImageWork:
    """At most `workers` image jobs at once; `run` one, `close` to stop them all."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tandem-images")
        self._closed = threading.Event()

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args, stop=...)` on an image thread, once one is free; `stop()` turns true when this call is
        cancelled or the server closes, and the job is to end at its next check."""
        cancelled = threading.Event()

        def stop() -> bool:
            return cancelled.is_set() or self._closed.is_set()

        loop = asyncio.get_running_loop()
        try:  # a cancelled wait also cancels the job if it has not started
            return await loop.run_in_executor(self._pool, partial(job, *args, stop=stop))
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def close(self) -> None:
        """Stop every job at its next check, drop the queued ones; returns at once."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
