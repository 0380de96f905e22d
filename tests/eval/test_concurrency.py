"""The AIMD controller on a fake clock, and the limiter that follows it."""

from __future__ import annotations

import asyncio

import pytest

from tandem.client import Feedback
from tandem.config.eval import ConcurrencyConfig
from tandem.eval.concurrency import AdaptiveLimiter, AimdController


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


def test_doubles_per_window_up_to_max_then_adds_increase_after_a_decrease():
    control, clock = controller(initial=2, min=1, max=16, increase=2)
    succeed(control, clock, 1)
    assert control.limit == 2  # a window is one success per request in flight
    succeed(control, clock, 1)
    assert control.limit == 4
    succeed(control, clock, 4 + 8)
    assert control.limit == 16
    succeed(control, clock, 40)
    assert control.limit == 16
    control.record(Feedback(started_at=clock.now, latency_s=1.0, overload="5xx"))
    assert control.limit == 8 == control.threshold
    succeed(control, clock, 8)
    assert control.limit == 10  # from the threshold on, `increase` per window


def test_a_run_of_decreases_doubles_back_to_where_the_first_one_landed():
    control, clock = controller(initial=16, min=1, max=16)
    for _ in range(3):  # three waves of errors, no window holding in between
        clock.now += 1
        control.record(Feedback(started_at=clock.now, latency_s=1.0, overload="timeout"))
    assert control.limit == 2 and control.threshold == 8
    succeed(control, clock, 2)
    assert control.limit == 4
    succeed(control, clock, 4)
    assert control.limit == 8
    succeed(control, clock, 8)
    assert control.limit == 9


def test_backs_off_when_latency_grows_past_the_tolerance():
    control, clock = controller(initial=16, max=128, latency_tolerance=2.0)
    succeed(control, clock, 16, latency=1.0)
    assert control.limit == 32 and control.baseline_s == 1.0
    succeed(control, clock, 32, latency=1.8)
    assert control.limit == 64 and control.baseline_s == pytest.approx(1.2)  # a moving average of the windows that held
    succeed(control, clock, 64, latency=3.0)
    assert control.limit == 32  # 2.5x the baseline
    succeed(control, clock, 32, latency=1.5)  # the decrease helped: the latency was ours
    assert control.limit == 33 and control.baseline_s == pytest.approx(1.275)


def test_small_windows_only_grow_the_limit():
    control, clock = controller(initial=2, max=64)
    succeed(control, clock, 2, latency=1.0)
    succeed(control, clock, 4, latency=9.0)  # a window of 4 says little: rollout lengths vary
    succeed(control, clock, 8, latency=0.5)
    assert control.limit == 16 and control.baseline_s is None
    succeed(control, clock, 16, latency=1.0)
    assert control.limit == 32 and control.baseline_s == 1.0


def test_latency_that_stays_at_the_lower_limit_becomes_the_baseline():
    control, clock = controller(initial=16, max=64, latency_tolerance=2.0)
    succeed(control, clock, 16, latency=1.0)
    succeed(control, clock, 32, latency=5.0)  # longer tasks from here on
    assert control.limit == 16
    succeed(control, clock, 16, latency=4.5)  # halving the limit hardly helped
    assert control.limit == 17 and control.baseline_s == 4.5
    succeed(control, clock, 17, latency=5.0)
    assert control.limit == 18


def test_a_server_queue_alone_never_shrinks_the_limit():
    control, clock = controller(initial=4, max=16)
    for queue in (0, 1, 0, 3, 1, 8):
        succeed(control, clock, control.limit, queue=queue)
    assert control.limit == 16


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
