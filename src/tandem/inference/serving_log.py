"""The serving summary: every `log_interval_s`, one log line and one record appended to
`<run_dir>/inference_metrics.jsonl`: requests that ended in the interval, generated tokens per second over it,
sequences running, requests waiting, and the share of KV-cache blocks in use. A record is written even when the
server is idle, so the time of the last one tells a dashboard whether the server is still alive.

For RL measurements each record also holds the interval's weight swaps and the seconds they paused generation
(`weight_swaps`, `swap_pause_s`), the share of the interval the engine thread spent running steps rather than
waiting for work (`busy_fraction`: inference idle is 1 minus it), and this process's peak GPU memory so far
(`peak_allocated_gib`, `peak_reserved_gib`; null on CPU).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.inference.engine import EngineStats
from tandem.jsonl import JsonlWriter

logger = logging.getLogger(__name__)

INFERENCE_METRICS_FILE = "inference_metrics.jsonl"


def _gib(size: int | None) -> float | None:
    return None if size is None else round(size / 2**30, 3)


class ServingSummary:
    """Turns successive engine stats into interval records and writes them."""

    def __init__(self, stats: Callable[[], EngineStats], run_dir: Path) -> None:
        self._stats = stats
        self._writer = JsonlWriter(run_dir / INFERENCE_METRICS_FILE)
        self._last = (time.monotonic(), stats())

    def record(self) -> dict[str, Any]:
        """The interval since the previous record (or since start)."""
        now, stats = time.monotonic(), self._stats()
        then, before = self._last
        self._last = (now, stats)
        span = now - then
        generated = stats.generated_tokens - before.generated_tokens
        return {
            "time": round(time.time(), 3),
            "requests": stats.requests_finished - before.requests_finished,
            "tokens_per_s": round(generated / span, 2) if span > 0 else 0.0,
            "running": stats.running,
            "waiting": stats.waiting_requests,
            "kv_usage": round(stats.kv_blocks_used / max(stats.kv_blocks_total, 1), 4),
            "weight_swaps": stats.weight_swaps - before.weight_swaps,
            "swap_pause_s": round(stats.swap_pause_s - before.swap_pause_s, 4),
            "busy_fraction": round(min(1.0, (stats.busy_s - before.busy_s) / span), 4) if span > 0 else 0.0,
            "peak_allocated_gib": _gib(stats.peak_allocated_bytes),
            "peak_reserved_gib": _gib(stats.peak_reserved_bytes),
        }

    def write(self) -> dict[str, Any]:
        record = self.record()
        logger.info(
            "serving: %d requests done, %.1f tokens/s, %d running, %d waiting, KV cache %.1f%% used, busy %.0f%%%s",
            record["requests"],
            record["tokens_per_s"],
            record["running"],
            record["waiting"],
            100 * record["kv_usage"],
            100 * record["busy_fraction"],
            f", {record['weight_swaps']} weight swaps ({record['swap_pause_s']:.3f} s paused)"
            if record["weight_swaps"]
            else "",
        )
        self._writer.write(record)
        return record

    async def run(self, interval_s: float) -> None:
        """Write a record every `interval_s` until cancelled."""
        try:
            while True:
                await asyncio.sleep(interval_s)
                self.write()
        finally:
            self._writer.close()
