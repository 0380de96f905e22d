"""Tests wait for child processes by their progress: a slow child runs to its end, a silent one is killed."""

from __future__ import annotations

import time

import pytest

from tandem.testing.progress import Stalled, run_while_progressing


def test_a_child_that_keeps_printing_runs_past_the_stall_limit():
    started = time.monotonic()
    result = run_while_progressing(["sh", "-c", "for i in 1 2 3 4 5 6; do echo $i; sleep 0.5; done"], stall_s=2)
    assert result.returncode == 0 and result.stdout.split() == ["1", "2", "3", "4", "5", "6"]
    assert time.monotonic() - started > 2.5  # longer than the stall limit: it counted progress, not time


def test_a_child_that_keeps_writing_files_runs_past_the_stall_limit(tmp_path):
    script = f"for i in 1 2 3 4 5 6; do echo $i >> {tmp_path}/out/log; sleep 0.5; done; echo done >&2"
    (tmp_path / "out").mkdir()
    result = run_while_progressing(["sh", "-c", script], watch=[tmp_path / "out"], stall_s=2)
    assert result.returncode == 0 and result.stderr == "done\n"


def test_a_child_that_stops_making_progress_is_killed():
    started = time.monotonic()
    with pytest.raises(Stalled, match=r"no progress for 1 s, killed; its stderr ends:\nworking"):
        run_while_progressing(["sh", "-c", "echo working >&2; exec sleep 60"], stall_s=1)
    assert time.monotonic() - started < 30
