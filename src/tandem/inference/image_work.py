"""Decoding requests' images off the event loop, a bounded number at once across the server, and stoppable.

A request's images are decoded on one of `workers` threads of their own, never on the event loop nor on the
default executor the routes tokenize on, so images cannot hold up `/health`, tokenizing or each other beyond that
cap, and what decoding holds at once is bounded by `workers` images of at most `max_image_pixels`. Every job is
asked between images whether to go on: when its request is cancelled (the client went away, or the server is
shutting down and cancels its handlers) or the server closes, it ends after the image in hand, and a job still
queued never starts, so shutdown waits for at most one image per worker.

What requests hold once decoded is bounded across the server too (`PixelBudget`): a request's images are
reserved by their header pixels before the first is decoded and released when the engine lets go of their pixel
values (the vision tower ran, or the request ended), so requests queued with images cannot together outgrow
memory; a request waits for room instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
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


class PixelBudget:
    """Pixels (as their headers state: an upper bound on what is kept at the model's size) that requests' decoded
    images may hold at once across the server. `reserve` waits on the event loop for room; a reservation is given
    back from whichever thread frees the last of its tensors (the engine's, once the vision tower ran)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[None]] = []  # touched on the event loop only

    async def reserve(self, pixels: int) -> Reservation:
        """Hold `pixels` once the images already held leave room (at once if they do); ValueError for more than
        the whole budget, which no wait could make room for. A cancelled wait holds nothing."""
        if pixels > self.limit:
            raise ValueError(
                f"the images have {pixels:,} pixels together, over the server's {self.limit:,} "
                "(max_server_image_pixels)"
            )
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self.held + pixels <= self.limit:
                    self.held += pixels
                    return Reservation(self, pixels, loop)
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _give_back(self, pixels: int, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self.held -= pixels
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """Every waiter checks again for room (on the loop, so none is appended while this runs)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class Reservation:
    """Pixels held in a `PixelBudget`, given back once: by `release`, or when every tensor passed to
    `release_when_freed` has been freed, on whichever thread frees it."""

    def __init__(self, budget: PixelBudget, pixels: int, loop: asyncio.AbstractEventLoop) -> None:
        self._budget, self._pixels, self._loop = budget, pixels, loop
        self._lock = threading.Lock()
        self._alive = 0
        self._released = False

    def release_when_freed(self, tensors: list[Any]) -> None:
        """Give the pixels back once all of `tensors` (the request's pixel values) are freed; at once if none."""
        if not tensors:
            self.release()
            return
        with self._lock:
            self._alive += len(tensors)
        for tensor in tensors:
            weakref.finalize(tensor, self._freed)

    def _freed(self) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last:
            self.release()

    def release(self) -> None:
        """Give the pixels back now (a request whose images failed or were cancelled); later calls do nothing."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._budget._give_back(self._pixels, self._loop)
