"""The inference pool: idle time counts only spans with nothing in flight; file policy loads roll back only first."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.config.orchestrator import InferencePoolConfig
from tandem.orchestrator.pool import InferencePool
from tandem.transport.weights.file import FileFollower


def test_idle_time_counts_only_gaps_with_nothing_in_flight():
    pool = InferencePool(InferencePoolConfig(base_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"]))
    with pool._busy(0):
        start = pool.idle_s
        with pool._busy(1):  # overlapping requests on two servers: never idle
            time.sleep(0.05)
        time.sleep(0.05)
    assert pool.idle_s == start
    time.sleep(0.2)  # nothing in flight
    with pool._busy(1):
        pass
    assert pool.idle_s - start == pytest.approx(0.2, abs=0.05)
    assert pool.in_flight == [0, 0]


def test_only_the_first_policy_load_may_roll_the_servers_back(tmp_path):
    """A resumed run's first policy may be older than what long-lived servers serve; later loads never roll back."""
    pool = InferencePool(InferencePoolConfig(base_urls=["http://127.0.0.1:1"]))
    sent = []

    async def request(method, route, body=None):
        sent.append((route, body))

    pool.clients[0].request = request
    follower = FileFollower(pool, tmp_path)
    asyncio.run(follower.load(tmp_path / "step-3", 3))
    asyncio.run(follower.load(tmp_path / "step-4", 4))
    updates = [body for route, body in sent if route == "/update_weights"]
    assert [(u["version"], u["rollback"]) for u in updates] == [(3, True), (4, False)]
    assert [route for route, _ in sent[:3]] == ["/pause", "/update_weights", "/resume"]
    assert pool.version == 4 and pool.loaded
