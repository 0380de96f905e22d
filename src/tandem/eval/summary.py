"""Per-source results from the trace stream: mean reward, pass@k, outcomes, tokens, latency.

Computed from the traces alone, so a resumed eval summarises every rollout it
has, not only the ones of the last process. Timed-out rollouts are scored
(reward 0, never a pass); errored ones are counted but left out of reward and
pass@k, since they say nothing about the model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

OUTCOMES = ("ok", "truncated", "timeout", "error")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from n samples with c passes (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def report_ks(rollouts_per_task: int) -> list[int]:
    """The k of pass@k to report: powers of two below the rollouts per task, and that number itself."""
    ks = [2**i for i in range(rollouts_per_task.bit_length()) if 2**i < rollouts_per_task]
    return [*ks, rollouts_per_task]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_source(
    records: Sequence[dict[str, Any]], *, expected: int, rollouts_per_task: int, pass_threshold: float
) -> dict[str, Any]:
    """The summary of one source's trace records (`expected`: rollouts it should have)."""
    outcomes = dict.fromkeys(OUTCOMES, 0)
    per_task: dict[str, list[bool]] = defaultdict(list)
    rewards = []
    for record in records:
        outcomes[record["outcome"]] += 1
        if record["outcome"] != "error":
            rewards.append(record["reward"])
            per_task[record["task"]["id"]].append(record["reward"] >= pass_threshold)
    pass_k = {}
    for k in report_ks(rollouts_per_task):
        estimates = [pass_at_k(len(p), sum(p), k) for p in per_task.values() if len(p) >= k]
        pass_k[str(k)] = sum(estimates) / len(estimates) if estimates else None
    completion_tokens = [record["tokens"]["completion"] for record in records]
    latencies = [record["latency_s"] for record in records]
    return {
        "tasks": len({record["task"]["id"] for record in records}),
        "rollouts": len(records),
        "missing": expected - len(records),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "pass_at_k": pass_k,
        "outcomes": outcomes,
        "tokens": {
            "prompt": sum(record["tokens"]["prompt"] for record in records),
            "completion": sum(completion_tokens),
            "completion_mean": sum(completion_tokens) / len(records) if records else None,
        },
        "latency_s": {f"p{q}": percentile(latencies, q) for q in (50, 90, 99)},
    }


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rows(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one cell per source) for every line of the table."""
    columns = list(summaries.values())
    ks = sorted({int(k) for summary in columns for k in summary["pass_at_k"]})
    rows = [
        ("tasks", [str(s["tasks"]) for s in columns]),
        ("rollouts", [str(s["rollouts"]) for s in columns]),
        ("mean reward", [_number(s["mean_reward"]) for s in columns]),
        *((f"pass@{k}", [_number(s["pass_at_k"].get(str(k))) for s in columns]) for k in ks),
        *((outcome, [str(s["outcomes"][outcome]) for s in columns]) for outcome in OUTCOMES),
        ("prompt tokens", [str(s["tokens"]["prompt"]) for s in columns]),
        ("completion tokens", [str(s["tokens"]["completion"]) for s in columns]),
        ("tokens / rollout", [_number(s["tokens"]["completion_mean"], 1) for s in columns]),
    ]
    for q in ("p50", "p90", "p99"):
        rows.append((f"latency {q} (s)", [_number(s["latency_s"][q], 2) for s in columns]))
    return rows


def render_table(summaries: dict[str, dict[str, Any]], console: Console) -> None:
    """A column per source, a row per number, so sources compare side by side."""
    table = Table(title="eval summary")
    table.add_column("")
    for name in summaries:
        table.add_column(name, justify="right")
    for label, cells in _rows(summaries):
        table.add_row(label, *cells)
    console.print(table)
