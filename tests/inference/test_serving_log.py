"""The inference server's periodic serving summary: one log line and one `inference_metrics.jsonl` record per
interval, busy or idle."""

from __future__ import annotations

import logging

from support.polling import wait_until
from tandem.inference.serving_log import INFERENCE_METRICS_FILE, ServingSummary
from tandem.jsonl import read_records
from tandem.wire.protocol import SamplingParams

KEYS = {
    "time", "requests", "tokens_per_s", "running", "waiting", "kv_usage",
    "weight_swaps", "swap_pause_s", "busy_fraction", "peak_allocated_gib", "peak_reserved_gib",
}  # fmt: skip


def test_each_record_covers_its_interval_and_an_idle_server_still_writes_one(make_engine, tmp_path, caplog):
    engine = make_engine()
    summary = ServingSummary(engine.stats, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate([[5, 6, 7], [8, 9]], params)
    with caplog.at_level(logging.INFO, logger="tandem.inference.serving_log"):
        busy = summary.write()
        wait_until(lambda: engine.gauges.running == 0, message="the engine's gauges after the last step")
        idle = summary.write()
    assert read_records(tmp_path / INFERENCE_METRICS_FILE) == [busy, idle]
    assert set(busy) == KEYS and busy["requests"] == 2 and busy["tokens_per_s"] > 0
    assert idle["requests"] == 0 and idle["tokens_per_s"] == 0 and idle["running"] == idle["waiting"] == 0
    assert 0 <= idle["kv_usage"] <= 1 and idle["time"] >= busy["time"]
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.inference.serving_log"]
    assert len(lines) == 2 and lines[0].startswith("serving: 2 requests done") and "KV cache" in lines[0]

    resumed = ServingSummary(engine.stats, tmp_path)  # a restarted server appends to the same file
    resumed.write()
    assert len(read_records(tmp_path / INFERENCE_METRICS_FILE)) == 3
