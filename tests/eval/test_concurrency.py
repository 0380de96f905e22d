"""The AIMD controller on a fake clock, and the limiter that follows it."""

from __future__ import annotations

import asyncio

import pytest

from tandem.config.eval import ConcurrencyConfig
from tandem.eval.concurrency import AdaptiveLimiter, AimdController, Feedback


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(**config) -> tuple[AimdController, Clock]:
    clock = Clock()
    return AimdController(ConcurrencyConfig(**config), clock=clock), clock


def succeed(control: AimdController, clock: Clock, count: int, latency: float = 1.0, queue: int | None = None) -> None:
    """`count` requests, each sent now and answered `latency` seconds later."""
    for _ in range(count):
        sent = clock.now
        clock.now += 0.001
        control.record(Feedback(started_at=sent, latency_s=latency, queue_depth=queue))


def test_grows_by_one_per_window_while_latency_holds_up_to_max():
    control, clock = controller(initial=2, min=1, max=4)
    succeed(control, clock, 1)
    assert control.limit == 2  # a window is one success per request in flight
    succeed(control, clock, 1)
    assert control.limit == 3
    succeed(control, clock, 3)
    assert control.limit == 4
    succeed(control, clock, 40)
    assert control.limit == 4


def test_holds_when_latency_grows_past_the_tolerance():
    control, clock = controller(initial=2, max=10, latency_tolerance=2.0)
    succeed(control, clock, 2, latency=1.0)
    assert control.limit == 3
    succeed(control, clock, 3, latency=1.9)
    assert control.limit == 4
    succeed(control, clock, 20, latency=2.5)
    assert control.limit == 4


@pytest.mark.parametrize("overload", ["timeout", "connection", "5xx", "429"])
def test_overload_halves_once_per_wave_down_to_min(overload):
    control, clock = controller(initial=8, min=3, max=8)
    wave = clock.now  # eight requests in flight, all sent before any answer
    clock.now += 1
    for _ in range(8):
        control.record(Feedback(started_at=wave, latency_s=1.0, overload=overload))
    assert control.limit == 4  # the other seven failures describe the load before the decrease
    clock.now += 1
    control.record(Feedback(started_at=clock.now, latency_s=1.0, overload=overload))
    assert control.limit == 3  # floored at min
    clock.now += 1
    control.record(Feedback(started_at=clock.now, latency_s=1.0, overload=overload))
    assert control.limit == 3


def test_successes_sent_before_a_change_do_not_fill_the_new_window():
    control, clock = controller(initial=4, max=8)
    old = clock.now
    clock.now += 1
    control.record(Feedback(started_at=old, latency_s=1.0, overload="timeout"))
    assert control.limit == 2
    for _ in range(5):
        control.record(Feedback(started_at=old, latency_s=1.0))
    assert control.limit == 2
    succeed(control, clock, 2)
    assert control.limit == 3


def test_a_growing_server_queue_shrinks_a_steady_one_does_not():
    control, clock = controller(initial=4, max=16)
    succeed(control, clock, 4, queue=2)
    succeed(control, clock, 5, queue=2)
    assert control.limit == 6  # steady queue, latency holds: still growing
    succeed(control, clock, 6, queue=5)
    assert control.limit == 3


def test_limits_must_be_ordered():
    with pytest.raises(ValueError, match="min <= initial <= max"):
        ConcurrencyConfig(initial=10, max=4)


def test_limiter_keeps_at_most_limit_in_flight_and_follows_it():
    async def scenario() -> list[int]:
        control, clock = controller(initial=2, min=1, max=3)
        limiter = AdaptiveLimiter(control)
        peaks: list[int] = []

        async def request() -> None:
            async with limiter:
                peaks.append(limiter.in_flight)
                await asyncio.sleep(0.01)
                limiter.record(Feedback(started_at=clock.now, latency_s=0.01))
                clock.now += 0.001

        await asyncio.gather(*(request() for _ in range(20)))
        assert limiter.in_flight == 0
        return peaks

    peaks = asyncio.run(scenario())
    assert max(peaks[:2]) <= 2 and max(peaks) == 3


def test_a_cancelled_waiter_gives_its_slot_back():
    async def scenario() -> None:
        limiter = AdaptiveLimiter(controller(initial=1)[0])
        await limiter.acquire()
        waiter = asyncio.create_task(limiter.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        limiter.release()  # frees the slot while the cancellation is pending
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert limiter.in_flight == 0
        await asyncio.wait_for(limiter.acquire(), timeout=1)
        assert limiter.in_flight == 1

    asyncio.run(scenario())
