"""The eval lock names its holder's pid, also to an eval refused in the instant after the holder took the lock
and before it wrote its pid; the pid is written in one record and cleared on release."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from tandem.config import ConfigError
from tandem.eval.lock import LOCK, PID_BYTES, run_lock


def test_a_second_eval_is_refused_naming_the_holder(tmp_path):
    with run_lock(tmp_path):
        record = (tmp_path / LOCK).read_bytes()
        assert len(record) == PID_BYTES and int(record) == os.getpid()
        with pytest.raises(ConfigError, match=rf"in use by another eval \(pid {os.getpid()}\)"), run_lock(tmp_path):
            pass
    assert (tmp_path / LOCK).read_bytes() == b""  # released: no pid claims it
    with run_lock(tmp_path):  # free again
        pass


def test_the_pid_is_read_once_the_holder_has_written_it(tmp_path):
    """A holder between `flock` and its write (an empty file, or a dead eval's old pid) is still named."""
    fd = os.open(tmp_path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"4194303\n", 0)  # left by an eval that was killed (above any live pid on Linux)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        writer = threading.Timer(0.2, lambda: os.pwrite(fd, f"{os.getpid():<19}\n".encode(), 0))
        writer.start()
        with pytest.raises(ConfigError, match=rf"\(pid {os.getpid()}\)"), run_lock(tmp_path):
            pass
        writer.join()
    finally:
        os.close(fd)
