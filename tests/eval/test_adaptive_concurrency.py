"""The AIMD controller against a simulated continuous-batching server on a virtual clock (no sleeps).

The server runs up to `slots` requests at once, one token each per engine step; a request that arrives
waits for the next step, so a saturated server always reports a small queue. The client keeps the
controller's limit in flight, as `run_rollouts` does, and reports every response as `Feedback`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tandem.client import Feedback
from tandem.config.eval import ConcurrencyConfig
from tandem.eval.concurrency import AimdController


@dataclass
class Request:
    sent: float
    tokens: int


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Simulation:
    """A closed loop of `controller.limit` requests against the simulated server."""

    controller: AimdController
    clock: Clock
    slots: int = 256
    """Requests the server runs at once; more wait in its queue."""
    step_s: float = 0.02
    """Seconds of an engine step with one request; `knee` more requests double it."""
    knee: int = 256
    length: Callable[[int], int] = lambda index: 20 + (index * 37) % 41
    """Tokens of request `index` (20..60 by default)."""
    fault: Callable[[float], str | None] = lambda now: None
    """The overload that responses finishing at `now` report ("5xx", "timeout", ...), or None."""
    slowdown: Callable[[float], float] = lambda now: 1.0
    """Factor on the step time at `now` (a slower server, or longer tasks)."""
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    sent: int = 0
    limits: list[int] = field(default_factory=list)
    """The limit after each response."""
    queues: list[int] = field(default_factory=list)
    """The queue depth each response reported."""
    times: list[float] = field(default_factory=list)
    """When each response came."""

    def _send(self) -> None:
        while len(self.waiting) + len(self.running) < self.controller.limit:
            self.waiting.append(Request(self.clock.now, self.length(self.sent)))
            self.sent += 1

    def run(self, responses: int) -> Simulation:
        self._send()
        while len(self.limits) < responses:
            joining = self.slots - len(self.running)
            self.running += self.waiting[:joining]
            del self.waiting[:joining]
            self.clock.now += self.step_s * (1 + len(self.running) / self.knee) * self.slowdown(self.clock.now)
            for request in self.running:
                request.tokens -= 1
            finished = [request for request in self.running if request.tokens == 0]
            self.running = [request for request in self.running if request.tokens > 0]
            for request in finished:  # answered one by one; each answer's successor queues behind the rest
                self.queues.append(len(self.waiting))
                self.times.append(self.clock.now)
                latency = self.clock.now - request.sent
                overload = self.fault(self.clock.now)
                self.controller.record(
                    Feedback(request.sent, latency, overload=overload, queue_depth=len(self.waiting))
                )
                self.limits.append(self.controller.limit)
                self._send()
        return self


def simulation(**server) -> Simulation:
    clock = Clock()
    controller = AimdController(ConcurrencyConfig(initial=4, min=1, max=64), clock=clock)
    return Simulation(controller, clock, **server)


def test_climbs_to_max_and_holds_it_against_a_small_standing_queue():
    sim = simulation().run(3000)
    assert 64 in sim.limits[:150]  # doubling from 4: within a few windows
    assert min(sim.limits[150:]) == 64  # never backs off: nothing is wrong with this server
    assert max(sim.queues[150:]) >= 2 and sum(q > 0 for q in sim.queues[150:]) > 1000  # a queue, and it varies


@pytest.mark.parametrize("seed", range(5))
def test_holds_a_high_limit_when_rollout_lengths_vary_widely(seed):
    lengths = random.Random(seed)
    sim = simulation(knee=64, length=lambda index: 5 + int(lengths.random() ** 2 * 300)).run(5000)
    steady = sim.limits[300:]  # 5 to 305 tokens: single windows are noisy, the limit must not follow them
    assert sum(steady) / len(steady) >= 48


def test_backs_off_when_slow_start_overshoots_what_the_server_runs_at_once():
    sim = simulation(slots=16).run(3000)  # more than 16 in flight only wait: latency grows with the limit
    first_decrease = next(i for i, (a, b) in enumerate(itertools.pairwise(sim.limits)) if b < a)
    assert sim.limits[first_decrease] == 64 and sim.limits[first_decrease + 1] == 32  # 4x the latency at 16
    assert min(sim.limits[first_decrease:]) >= 16  # never below what the server runs: it stays busy


def test_backs_off_on_errors_once_per_wave_then_climbs_back():
    sim = simulation(fault=lambda now: "5xx" if 20 <= now < 30 else None).run(5000)
    assert sim.clock.now > 40
    during = [limit for limit, now in zip(sim.limits, sim.times, strict=True) if 20 <= now < 30]
    assert during[-1] == 1 and all(b in (a, max(1, a // 2)) for a, b in itertools.pairwise(during))
    assert sim.limits[-1] >= 32  # doubled back to half the old limit, then probing up


def test_backs_off_on_timeouts():
    sim = simulation(fault=lambda now: "timeout" if 8 <= now < 9 else None).run(1500)
    before = [limit for limit, now in zip(sim.limits, sim.times, strict=True) if now < 8]
    assert before[-1] == 64 and min(sim.limits) <= 16
    assert sim.limits[-1] >= 32


def test_backs_off_when_the_server_slows_down_and_then_adopts_its_new_speed():
    sim = simulation(slowdown=lambda now: 4.0 if now >= 10 else 1.0).run(3000)
    assert 64 in sim.limits[:150]
    before = sim.limits.index(64)
    assert min(sim.limits[before:]) >= 32  # one decrease, not a fall to min window after window
    assert 32 in sim.limits[before:] and sim.limits[-1] > 32
