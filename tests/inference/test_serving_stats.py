"""The serving records' RL measurements: weight swaps and their pause, the engine's busy share, peak GPU memory."""

from __future__ import annotations

from support.polling import wait_until
from support.tiny_models import INIT_STD
from tandem.inference.serving_log import INFERENCE_METRICS_FILE, ServingSummary
from tandem.inference.weights import read_weights
from tandem.jsonl import read_records
from tandem.wire.protocol import SamplingParams


def test_records_count_the_intervals_swaps_and_busy_share(make_engine, tiny_model_dir, tmp_path):
    other = tiny_model_dir("qwen3", initializer_range=INIT_STD, seed=1)
    engine = make_engine()
    summary = ServingSummary(engine.stats, tmp_path)
    tensors = read_weights(other, engine.model)
    pauses = [engine.swap_weights(tensors, version=v).result(timeout=30) for v in (1, 2)]
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    working = summary.write()
    wait_until(lambda: engine.gauges.running == 0, message="the engine's gauges after the last step")
    idle = summary.write()

    assert working["weight_swaps"] == 2 and abs(working["swap_pause_s"] - round(sum(pauses), 4)) < 1e-3
    assert 0 < working["busy_fraction"] <= 1
    assert idle["weight_swaps"] == 0 and idle["swap_pause_s"] == 0
    assert idle["busy_fraction"] < working["busy_fraction"]
    assert working["peak_allocated_gib"] is None and working["peak_reserved_gib"] is None  # CPU
    stats = engine.stats()
    assert stats.weight_swaps == 2 and stats.policy_version == 2 and stats.busy_s > 0
    assert read_records(tmp_path / INFERENCE_METRICS_FILE) == [working, idle]
