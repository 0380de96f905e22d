"""The trace stream: stable keys, append-only lines, a half-written last line survived."""

from __future__ import annotations

import pytest

from tandem.eval.traces import TraceWriter, read_traces, trace_key


def test_keys_are_stable_and_distinct():
    assert trace_key("gsm8k", "gsm8k-test-0", 0) == trace_key("gsm8k", "gsm8k-test-0", 0)
    keys = {trace_key(s, t, r) for s in ("a", "b") for t in ("0", "1") for r in (0, 1)}
    assert len(keys) == 8
    assert trace_key("a:b", "c", 0) != trace_key("a", "b:c", 0)  # fields are not merely concatenated


def test_writer_appends_one_line_per_record(tmp_path):
    path = tmp_path / "run" / "traces.jsonl"
    assert read_traces(path) == []
    with TraceWriter(path) as writer:
        writer.write({"key": "a", "text": "line\nbreak é"})
        assert read_traces(path) == [{"key": "a", "text": "line\nbreak é"}]  # flushed at once
    with TraceWriter(path) as writer:
        writer.write({"key": "b"})
    assert [r["key"] for r in read_traces(path)] == ["a", "b"]
    assert path.read_text().count("\n") == 2


def test_a_half_written_last_line_is_ignored_then_cut_off(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"key": "a"}\n{"key": "b", "rew')
    assert read_traces(path) == [{"key": "a"}]
    with TraceWriter(path) as writer:
        writer.write({"key": "c"})
    assert path.read_text() == '{"key": "a"}\n{"key": "c"}\n'
    path.write_text('{"key": "only half')
    TraceWriter(path).close()
    assert path.read_text() == ""


def test_a_bad_complete_line_is_an_error(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"key": "a"}\nnot json\n{"key": "b"}\n')
    with pytest.raises(ValueError, match=r"traces\.jsonl:2"):
        read_traces(path)
