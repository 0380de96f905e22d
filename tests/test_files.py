"""Atomic writes: the new file appears whole, synced before its rename, and a failed write leaves the old one."""

from __future__ import annotations

import pytest

from tandem import files
from tandem.files import atomic_path, atomic_write_text


def test_a_path_writer_replaces_the_file_only_once_it_is_synced(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "batch.bin"
    synced = []
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(target.exists()))
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and synced == [False]  # synced under its temporary name
    assert [p.name for p in target.parent.iterdir()] == ["batch.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "config.toml"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.toml"]
