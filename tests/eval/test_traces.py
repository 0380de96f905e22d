"""The trace stream: stable keys, append-only lines, a half-written last line survived, corrupt and repeated
lines skipped with a warning."""

from __future__ import annotations

import json
import logging

from tandem.eval.traces import read_traces, trace_key
from tandem.jsonl import JsonlWriter


def trace(key: str, **fields) -> dict:
    """A minimal well-formed trace record."""
    record = {
        "key": key, "source": "s", "task": {"id": f"t-{key}"}, "rollout": 0, "reward": 1.0, "outcome": "ok",
        "tokens": {"prompt": 3, "completion": 4}, "latency_s": 0.5,
    }  # fmt: skip
    return {**record, **fields}


def lines(*records) -> str:
    return "".join(json.dumps(record) + "\n" if isinstance(record, dict) else record for record in records)


def test_keys_are_stable_and_distinct():
    assert trace_key("gsm8k", "gsm8k-test-0", 0) == trace_key("gsm8k", "gsm8k-test-0", 0)
    keys = {trace_key(s, t, r) for s in ("a", "b") for t in ("0", "1") for r in (0, 1)}
    assert len(keys) == 8
    assert trace_key("a:b", "c", 0) != trace_key("a", "b:c", 0)  # fields are not merely concatenated


def test_writer_appends_one_line_per_record(tmp_path):
    path = tmp_path / "run" / "traces.jsonl"
    assert read_traces(path) == []
    with JsonlWriter(path) as writer:
        writer.write(trace("a", text="line\nbreak é"))
        assert read_traces(path) == [trace("a", text="line\nbreak é")]  # flushed at once
    with JsonlWriter(path) as writer:
        writer.write(trace("b"))
    assert [r["key"] for r in read_traces(path)] == ["a", "b"]
    assert path.read_text().count("\n") == 2


def test_a_half_written_last_line_is_ignored_then_cut_off(tmp_path, caplog):
    path = tmp_path / "traces.jsonl"
    path.write_text(lines(trace("a"), '{"key": "b", "rew'))
    with caplog.at_level(logging.WARNING):
        assert read_traces(path) == [trace("a")]
    assert not caplog.records  # a line still being written is not corrupt
    with JsonlWriter(path) as writer:
        writer.write(trace("c"))
    assert path.read_text() == lines(trace("a"), trace("c"))


def test_corrupt_lines_are_skipped_and_named(tmp_path, caplog):
    path = tmp_path / "traces.jsonl"
    no_outcome = {k: v for k, v in trace("x").items() if k != "outcome"}
    path.write_text(
        lines(trace("a"), "not json\n", "[1, 2]\n", no_outcome, trace("y", reward="high"), trace("b"), "\n")
    )
    with caplog.at_level(logging.WARNING, logger="tandem.eval.traces"):
        assert [r["key"] for r in read_traces(path)] == ["a", "b"]
    assert [r.getMessage() for r in caplog.records] == [f"{path}: skipped 4 corrupt line(s) (line 2, 3, 4, 5)"]


def test_a_repeated_rollout_counts_once_the_first_time(tmp_path, caplog):
    path = tmp_path / "traces.jsonl"
    path.write_text(lines(trace("a"), trace("b"), trace("a", reward=0.0), trace("c"), trace("b", reward=0.0)))
    with caplog.at_level(logging.WARNING, logger="tandem.eval.traces"):
        records = read_traces(path)
    assert [(r["key"], r["reward"]) for r in records] == [("a", 1.0), ("b", 1.0), ("c", 1.0)]
    message = caplog.records[0].getMessage()
    assert "skipped 2 line(s) repeating a rollout already read (line 3, 5)" in message
