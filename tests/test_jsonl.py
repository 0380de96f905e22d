"""The one JSONL module: half-written lines wait, corrupt lines are skipped and counted, files that shrink restart."""

import json

import pytest

from tandem import jsonl
from tandem.jsonl import CorruptLineError, JsonlFollower, JsonlReport, JsonlWriter, keep_steps_up_to, read_records


def test_read_skips_half_written_and_corrupt_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n\nnot json\n[1, 2]\n{"step": 2}\n{"step": 3')
    report = JsonlReport()
    assert read_records(path, report=report) == [{"step": 1}, {"step": 2}]
    assert (report.corrupt, report.examples) == (2, [3, 4])
    with pytest.raises(CorruptLineError, match=r"m\.jsonl:3"):
        read_records(path, strict=True)
    assert read_records(tmp_path / "missing.jsonl") == []


def test_follower_survives_a_file_that_shrinks_mid_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "pad": "x" * 50}) + "\n" for s in range(1, 6)))
    follower = JsonlFollower(path)
    assert [r["step"] for r in follower.new_records()] == [1, 2, 3, 4, 5]
    keep_steps_up_to(path, 2)  # a resumed run rewrites the file shorter than the follower's offset
    assert [r["step"] for r in follower.new_records()] == [1, 2] and follower.restarted
    with path.open("a") as handle:
        handle.write('{"step": 3}\n{"ste')
    assert [r["step"] for r in follower.new_records()] == [3] and not follower.restarted
    with path.open("a") as handle:
        handle.write('p": 4}\n')
    assert [r["step"] for r in follower.new_records()] == [4]
    with path.open("a") as handle:
        handle.write("oops\n")
    assert follower.new_records() == [] and (follower.report.corrupt, follower.report.examples) == (1, [5])
    keep_steps_up_to(path, 1)
    assert [r["step"] for r in follower.new_records()] == [1] and follower.report.corrupt == 0


def test_follower_rereads_a_replaced_file_of_the_same_size(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n')
    follower = JsonlFollower(path)
    assert follower.new_records() == [{"step": 1}]
    replacement = tmp_path / "new.jsonl"
    replacement.write_text('{"step": 7}\n')
    replacement.replace(path)
    assert follower.new_records() == [{"step": 7}] and follower.restarted


def test_writer_cuts_a_half_written_line_before_appending(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2')
    with JsonlWriter(path) as writer:
        writer.write({"a": "é"})
    assert read_records(path) == [{"a": 1}, {"a": "é"}]
    with JsonlWriter(path, truncate=True) as writer:
        writer.write({"a": 3})
    assert read_records(path) == [{"a": 3}]


def test_every_append_is_synced_before_write_returns(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    synced = []
    monkeypatch.setattr(jsonl, "_sync", lambda fd: synced.append(len(read_records(path))))
    with JsonlWriter(path) as writer:
        writer.write({"step": 1})
        writer.write({"step": 2})
    assert synced == [1, 2]  # each line reached the file before its sync


def test_keep_steps_up_to_leaves_a_file_with_nothing_to_drop_untouched(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    inode = path.stat().st_ino
    keep_steps_up_to(path, 2)
    assert path.stat().st_ino == inode
    keep_steps_up_to(path, 1)
    assert read_records(path) == [{"step": 1}] and path.stat().st_ino != inode
    path.write_text('{"step": 1}\n{"st')
    keep_steps_up_to(path, 5)
    assert path.read_text() == '{"step": 1}\n'
