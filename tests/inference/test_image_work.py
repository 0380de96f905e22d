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
        images.release.set()  # the image in hand finishes
        for task in (running, queued):
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
