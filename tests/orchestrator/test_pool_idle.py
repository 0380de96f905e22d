"""Inference idle time counts only the spans with no request in flight on any server."""

from __future__ import annotations

import time

import pytest

from tandem.config.orchestrator import InferencePoolConfig
from tandem.orchestrator.pool import InferencePool


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
