"""One eval at a time in a run directory: an exclusive `flock` on `<run>/.lock`, held while the eval runs.

Two processes appending to one trace stream would both run the rollouts they found missing, so the
second one to start is refused, naming the holder's pid (written into the lock file). The kernel drops
the lock when its holder exits, however it exits, so a killed eval never leaves a stale lock; the file
itself stays (removing it would race with a process that has just opened it).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.config import ConfigError

LOCK = ".lock"


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block; a ConfigError naming the holder if another process has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"{run_dir} is in use by another eval (pid {holder}); wait for it to finish or stop it, "
                "then run again"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
