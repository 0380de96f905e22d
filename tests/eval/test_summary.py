"""Summaries from trace records: the unbiased pass@k, outcome counts, what errors and timeouts count for."""

from __future__ import annotations

import itertools
import math

import pytest
from rich.console import Console

from tandem.eval.summary import pass_at_k, percentile, render_table, report_ks, summarize_source


def brute_force_pass_at_k(passes: list[bool], k: int) -> float:
    draws = list(itertools.combinations(passes, k))
    return sum(any(draw) for draw in draws) / len(draws)


@pytest.mark.parametrize("passes", [[True], [False, False], [True, False, False, True, False], [False] * 4 + [True]])
def test_pass_at_k_is_the_unbiased_estimator(passes):
    for k in range(1, len(passes) + 1):
        assert math.isclose(pass_at_k(len(passes), sum(passes), k), brute_force_pass_at_k(passes, k))


def test_reported_ks():
    assert report_ks(1) == [1]
    assert report_ks(5) == [1, 2, 4, 5]
    assert report_ks(8) == [1, 2, 4, 8]


def test_percentiles_interpolate():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert math.isclose(percentile([0.0, 10.0], 90), 9.0)


def record(task: str, reward: float, outcome: str = "ok", latency: float = 1.0) -> dict:
    return {
        "source": "s",
        "task": {"id": task},
        "reward": reward,
        "outcome": outcome,
        "tokens": {"prompt": 10, "completion": 4},
        "latency_s": latency,
    }


def test_summary_counts_timeouts_as_failures_and_leaves_errors_out():
    records = [
        record("a", 1.0),
        record("a", 0.0, "timeout"),
        record("b", 1.0, "truncated"),
        record("b", 0.0, "error"),
        record("c", 0.5),
        record("c", 1.0),
    ]
    summary = summarize_source(records, expected=8, rollouts_per_task=2, pass_threshold=1.0)
    assert summary["tasks"] == 3 and summary["rollouts"] == 6 and summary["missing"] == 2
    assert summary["outcomes"] == {"ok": 3, "truncated": 1, "timeout": 1, "error": 1}
    assert summary["mean_reward"] == pytest.approx(3.5 / 5)
    assert summary["pass_at_k"]["1"] == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    assert summary["pass_at_k"]["2"] == pytest.approx(1.0)  # b has one scored rollout: too few for k=2
    assert summary["tokens"] == {"prompt": 60, "completion": 24, "completion_mean": 4.0}
    assert summary["latency_s"]["p50"] == 1.0


def test_an_empty_source_summarises_to_nothing_and_renders(capsys):
    summary = summarize_source([], expected=0, rollouts_per_task=1, pass_threshold=1.0)
    assert summary["mean_reward"] is None and summary["pass_at_k"] == {"1": None}
    console = Console(width=120, force_terminal=False)
    render_table(
        {
            "empty": summary,
            "one": summarize_source([record("a", 1.0)], expected=1, rollouts_per_task=4, pass_threshold=1.0),
        },
        console,
    )
    out = capsys.readouterr().out
    assert "empty" in out and "pass@4" in out and "mean reward" in out
