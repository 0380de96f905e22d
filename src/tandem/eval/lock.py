"""One eval at a time in a run directory: an exclusive `flock` on `<run>/.lock`, held while the eval runs.

Two processes appending to one trace stream would both run the rollouts they found missing, so the
second one to start is refused, naming the holder's pid. The holder writes its pid into the lock file in one
fixed-size write (`PID_BYTES`, never truncated to empty first) right after taking the lock, and empties it
when it ends; a refused process that reads no live pid (the holder took the lock an instant ago) reads again
for up to `PID_WAIT_S`. The kernel drops the lock when its holder exits, however it exits, so a killed eval
never leaves a stale lock; the file itself stays (removing it would race with a process that has just opened
it).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.config import ConfigError

LOCK = ".lock"
PID_BYTES = 20
"""The size of the lock file's record: the holder's pid, space-padded, and a newline."""
PID_WAIT_S = 2.0
"""How long a refused eval waits for the holder to write its pid."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def holder_pid(fd: int, wait_s: float = PID_WAIT_S) -> int | None:
    """The pid the lock file `fd` names, once it names a live process (None after `wait_s` without one)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if text.isdigit() and _alive(int(text)):
            return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block; a ConfigError naming the holder's pid if another process has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = holder_pid(fd)
            raise ConfigError(
                f"{run_dir} is in use by another eval (pid {pid if pid is not None else 'unknown'}); wait for it "
                "to finish or stop it, then run again"
            ) from None
        os.pwrite(fd, f"{os.getpid():<{PID_BYTES - 1}}\n".encode(), 0)  # one write: never seen half done
        os.ftruncate(fd, PID_BYTES)  # drops what a longer, older record left beyond it
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # no pid while nobody holds the lock
    finally:
        os.close(fd)
