"""Waiting in tests for something another thread does, with no wall-clock timeout."""

from __future__ import annotations

from collections.abc import Callable

from tandem.testing.progress import Stalled, wait_for


def wait_until(condition: Callable[[], bool], message: str = "condition") -> None:
    """Poll `condition` until it holds; fail only after the stall limit (a loaded machine is slow, not stuck)."""
    try:
        wait_for(condition, poll_s=0.01)
    except Stalled as error:
        raise AssertionError(f"waiting for {message}: {error}") from None
