"""Tests wait for child processes by their progress: a slow child runs to its end, a silent one is killed with
what it started."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tandem.testing.progress import Stalled, run_while_progressing, spawn, wait_for


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


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper has stopped running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stalled_child_is_killed_with_the_processes_it_started(tmp_path):
    pidfile = tmp_path / "grandchild"  # like torchrun's ranks: started by the child, silent, in its group
    with pytest.raises(Stalled, match="no progress for 1 s"):
        run_while_progressing(["sh", "-c", f"sleep 60 & echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait"],
                              stall_s=1)  # fmt: skip
    grandchild = int(pidfile.read_text())
    wait_for(lambda: not _alive(grandchild), stall_s=30)  # SIGKILL lands at once; a survivor sleeps 60 s


def test_wait_until_returns_while_the_child_runs_and_fails_once_it_ended(tmp_path):
    flag = tmp_path / "flag"
    with spawn(["sh", "-c", f"sleep 0.3; touch {flag}; sleep 60"], stall_s=30) as child:
        child.wait_until(flag.exists, "the flag")
        assert not child.ended()
    assert child.ended()  # leaving the block killed it
    failed = r"exited with 3 before the flag; its stderr ends:\nbad input"
    with spawn(["sh", "-c", "echo bad input >&2; exit 3"]) as child, pytest.raises(AssertionError, match=failed):
        child.wait_until((tmp_path / "never").exists, "the flag")
