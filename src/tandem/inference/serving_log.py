"""The serving summary: every `log_interval_s`, one log line and one record appended to
`<run_dir>/inference_metrics.jsonl`: requests that ended in the interval, generated tokens per second over it,
sequences running, requests waiting, and the share of KV-cache blocks in use. A record is written even when the
server is idle, so the time of the last one tells a dashboard whether the server is still alive.
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

METRICS_FILE = "inference_metrics.jsonl"


class ServingSummary:
    """Turns successive engine stats into interval records and writes them."""

    def __init__(self, stats: Callable[[], EngineStats], run_dir: Path) -> None:
        self._stats = stats
        self._writer = JsonlWriter(run_dir / METRICS_FILE)
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
        }

    def write(self) -> dict[str, Any]:
        record = self.record()
        logger.info(
            "serving: %d requests done, %.1f tokens/s, %d running, %d waiting, KV cache %.1f%% used",
            record["requests"],
            record["tokens_per_s"],
            record["running"],
            record["waiting"],
            100 * record["kv_usage"],
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
