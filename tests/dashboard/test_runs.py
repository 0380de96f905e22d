"""Reading run directories: tolerant JSONL, downsampling, discovery and status."""

from __future__ import annotations

import json
import os

from tandem.dashboard import runs
from tandem.dashboard.runs import downsample, list_runs, read_jsonl, run_dir


def test_a_half_written_last_line_is_skipped(outputs):
    records = read_jsonl(outputs / "rl-run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]


def test_a_half_written_line_is_read_once_its_writer_finishes_it(outputs):
    path = outputs / "rl-run" / "metrics.jsonl"
    assert len(read_jsonl(path)) == 5
    with path.open("a") as handle:
        handle.write('ss": 0.1}\n{"step": 7}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6, 7]


def test_a_last_line_without_newline_counts_once(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    with path.open("a") as handle:
        handle.write('\n{"step": 3}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


def test_a_rewritten_file_is_read_from_the_start(tmp_path):
    """A resumed trainer cuts metrics.jsonl back to its resume step, or a writer replaces the file."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 11)))
    assert len(read_jsonl(path)) == 10
    path.write_text('{"step": 1}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1]
    replacement = tmp_path / "new.jsonl"
    replacement.write_text('{"step": 5}\n' * 20)
    os.replace(replacement, path)
    assert [r["step"] for r in read_jsonl(path)] == [5] * 20


def test_a_long_growing_run_is_read_incrementally(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 20_001)))
    assert len(read_jsonl(path)) == 20_000
    with path.open("a") as handle:
        handle.write(json.dumps({"step": 20_001}) + "\n")
    parsed = []
    parse = runs._parse
    monkeypatch.setattr(runs, "_parse", lambda lines: parsed.extend(lines) or parse(lines))
    records = read_jsonl(path)
    assert len(records) == 20_001 and records[-1] == {"step": 20_001}
    assert parsed == [b'{"step": 20001}']  # only the appended line


def test_downsample_keeps_first_and_last_and_bounds_the_count():
    records = list(range(10_000))
    points = downsample(records, 400)
    assert len(points) == 400
    assert points[0] == 0 and points[-1] == 9_999
    assert points == sorted(points)
    assert downsample(records[:5], 400) == records[:5]


def test_runs_are_discovered_with_kind_status_steps_and_reward(outputs):
    rows = {row["name"]: row for row in list_runs(outputs)}
    assert set(rows) == {"rl-run", "sft-old", "evals"}
    assert (rows["rl-run"]["kind"], rows["rl-run"]["status"], rows["rl-run"]["steps"]) == ("rl", "finished", 5)
    assert rows["rl-run"]["last_reward"] == 0.5
    assert (rows["sft-old"]["kind"], rows["sft-old"]["status"]) == ("sft", "failed")
    assert (rows["evals"]["kind"], rows["evals"]["status"], rows["evals"]["steps"]) == ("eval", "running", 6)


def test_only_direct_children_are_runs(outputs):
    assert run_dir(outputs, "rl-run") == outputs / "rl-run"
    for name in ("..", ".", "rl-run/../sft-old", "../" + outputs.name, "", "missing"):
        assert run_dir(outputs, name) is None
