"""`ImageWork`, where a server decodes requests' images: at most `workers` jobs at once, a cancelled request's job
ends after the image in hand and a queued one never starts, and `close` stops what is in flight, so shutdown
waits for one image per worker at most."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tandem.inference.image_work import ImageWork


class Images:
    """A fake job over `count` "images": each waits for `release` (or a timeout), the job asks `stop` before each."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.active = self.most_active = self.done = 0
        self.started = threading.Event()

    def job(self, count: int, stop) -> int:
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.started.set()
        try:
            for index in range(count):
                if stop():
                    return index
                self.release.wait(timeout=60)
                with self.lock:
                    self.done += 1
            return count
        finally:
            with self.lock:
                self.active -= 1


def test_jobs_run_at_most_workers_at_once():
    images = Images()
    images.release.set()

    async def main() -> list[int]:
        work = ImageWork(2)
        try:
            return await asyncio.gather(*(work.run(images.job, 3) for _ in range(6)))
        finally:
            work.close()

    assert asyncio.run(main()) == [3] * 6 and images.most_active <= 2 and images.done == 18


def test_a_cancelled_request_stops_after_its_image_and_a_queued_one_never_starts():
    images = Images()

    async def main() -> None:
        work = ImageWork(1)
        running = asyncio.ensure_future(work.run(images.job, 100))
        await asyncio.to_thread(images.started.wait, 60)
        queued = asyncio.ensure_future(work.run(images.job, 100))
        await asyncio.sleep(0)
        running.cancel()
        queued.cancel()
        for task in (running, queued):  # the cancellations land (the jobs are told to stop) before the image ends
            with contextlib.suppress(asyncio.CancelledError):
                await task
        images.release.set()  # the image in hand finishes
        while images.active:  # the running job's thread winds down
            await asyncio.sleep(0.01)
        work.close()

    asyncio.run(main())
    assert images.done == 1 and images.most_active == 1  # one image, and the queued job never ran


def test_close_stops_the_jobs_in_flight():
    images = Images()
    results: list[int] = []

    async def main() -> None:
        work = ImageWork(2)
        jobs = [asyncio.ensure_future(work.run(images.job, 100)) for _ in range(2)]
        while images.active < 2:
            await asyncio.sleep(0.01)
        work.close()
        images.release.set()
        results.extend(await asyncio.gather(*jobs))

    asyncio.run(main())
    assert results == [1, 1] and images.done == 2


def test_the_pixel_budget_holds_a_request_until_the_pixels_before_it_are_freed():
    """A request's pixels stay reserved until the engine frees its pixel tensors (here, on another thread, as the
    engine thread does once the vision tower ran); a request that would overrun the budget waits for that, one
    that could never fit is refused, and a cancelled wait holds nothing."""
    import gc

    import pytest
    import torch

    from tandem.inference.image_work import PixelBudget

    async def main() -> None:
        budget = PixelBudget(100)
        with pytest.raises(ValueError, match=r"101 pixels together, over the server's 100 \(max_server_image_pixels\)"):
            await budget.reserve(101)
        first = await budget.reserve(60)
        pixels = [torch.zeros(4), torch.zeros(4)]
        first.release_when_freed(pixels)
        second = asyncio.ensure_future(budget.reserve(50))
        cancelled = asyncio.ensure_future(budget.reserve(90))
        await asyncio.sleep(0.05)
        assert not second.done() and budget.held == 60
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        del pixels[0]
        gc.collect()
        await asyncio.sleep(0.05)
        assert not second.done()  # one of the request's two tensors is still held

        def engine_frees() -> None:
            pixels.clear()
            gc.collect()

        thread = threading.Thread(target=engine_frees)
        thread.start()
        thread.join()
        reservation = await asyncio.wait_for(second, timeout=30)
        assert budget.held == 50
        reservation.release()
        reservation.release()  # once only
        assert budget.held == 0

    asyncio.run(main())


def test_a_server_image_budget_below_a_requests_limit_is_refused():
    import pytest
    from pydantic import ValidationError

    from tandem.config.inference import InferenceConfig

    with pytest.raises(
        ValidationError, match=r"max_server_image_pixels \(999\) must be at least max_request_image_pixels"
    ):
        InferenceConfig(max_request_image_pixels=1_000, max_server_image_pixels=999)
