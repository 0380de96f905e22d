"""Waiting for a child process by its progress, not by the clock.

A fixed timeout fails a test on a slow or loaded machine although nothing is wrong. Tests here wait instead
for as long as the child keeps moving (its output grows, the files it writes change) and fail only when it
has stood still for a generous stall limit, which a hung child still hits.

A child runs in a session of its own and is killed with its whole process group, so that what it started
(torchrun's ranks, a browser's renderers) dies with it instead of outliving the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

STALL_S = 300.0
"""How long a child may show no progress at all before it counts as hung (loading a model on two loaded cores
takes well under a minute)."""


class Stalled(AssertionError):
    """The child made no progress for the stall limit: killed, with the tail of its output."""


def tree_state(paths: Iterable[Path]) -> tuple[int, ...]:
    """A fingerprint of everything under `paths` (files and folders, missing ones too) that changes whenever a
    file appears, disappears, grows or is rewritten."""
    state: list[int] = []
    for path in paths:
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                try:
                    stat = os.stat(os.path.join(root, name))
                except FileNotFoundError:  # removed while walking: the next look sees it
                    continue
                state += (stat.st_size, stat.st_mtime_ns)
            state.append(len(files))
    return tuple(state)


def _nothing() -> None:
    """No progress to watch: the wait is bounded by the stall limit alone."""


def wait_for(
    condition: Callable[[], bool],
    progress: Callable[[], object] = _nothing,
    *,
    stall_s: float = STALL_S,
    poll_s: float = 0.05,
    look_s: float = 1.0,
) -> None:
    """Poll `condition()` every `poll_s` until it holds; raise Stalled once `progress()` (looked at every
    `look_s`, since it may walk a folder) has returned the same value for `stall_s` seconds."""
    now = time.monotonic()
    last, moved, looked = progress(), now, now
    while not condition():
        time.sleep(poll_s)
        now = time.monotonic()
        if now - looked < look_s:
            continue
        looked, current = now, progress()
        if current != last:
            last, moved = current, now
        elif now - moved > stall_s:
            raise Stalled(f"no progress for {stall_s:.0f} s")


class WatchedChild:
    """A child started by `spawn`: its stdout and stderr go to files, whose growth (with any change under the
    watched paths) is its progress.

    The child is reaped only when it is killed: until then its pid, and so its process group's id, stays taken,
    and killing the group can never reach an unrelated process that was given the same id."""

    def __init__(
        self, process: subprocess.Popen, out: IO[bytes], err: IO[bytes], watched: list[Path], stall_s: float
    ) -> None:
        self.command = [str(arg) for arg in process.args]
        self.pid = process.pid
        self.stall_s = stall_s
        self._process, self._out, self._err, self._watched = process, out, err, watched

    @property
    def stdout(self) -> str:
        return _read(self._out)

    @property
    def stderr(self) -> str:
        return _read(self._err)

    def ended(self) -> bool:
        """Whether the child has exited (it stays unreaped)."""
        if self._process.returncode is not None:
            return True
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def progress(self) -> tuple:
        return os.fstat(self._out.fileno()).st_size, os.fstat(self._err.fileno()).st_size, tree_state(self._watched)

    def kill(self) -> int:
        """SIGKILL everything left in the child's process group, reap the child and return its exit status."""
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # the child left its group for another
                os.killpg(self.pid, signal.SIGKILL)
            self._process.wait()
        return self._process.returncode

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Wait, while the child runs and makes progress, until `condition()` holds. A stalled child is killed
        (Stalled); one that exits first fails the wait (AssertionError)."""
        self._wait(lambda: condition() or self.ended())
        if not condition():
            status = self.kill()
            raise AssertionError(f"{self.command} exited with {status} before {what}; {self._stderr_tail()}")

    def wait(self) -> subprocess.CompletedProcess[str]:
        """Wait for the child to exit, for as long as it makes progress, and kill what it left in its group."""
        self._wait(self.ended)
        return subprocess.CompletedProcess(self.command, self.kill(), self.stdout, self.stderr)

    def _wait(self, condition: Callable[[], bool]) -> None:
        try:
            wait_for(condition, self.progress, stall_s=self.stall_s)
        except Stalled as error:
            self.kill()
            raise Stalled(f"{self.command}: {error}, killed; {self._stderr_tail()}") from None

    def _stderr_tail(self) -> str:
        return f"its stderr ends:\n{self.stderr[-3000:]}"


@contextlib.contextmanager
def spawn(
    command: Sequence[str],
    *,
    watch: Iterable[str | Path] = (),
    stall_s: float = STALL_S,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Iterator[WatchedChild]:
    """Start `command` in a session of its own, as a WatchedChild whose progress is its output and the files under
    `watch`; leaving the block kills whatever is left of its process group."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
        child = WatchedChild(process, out, err, [Path(path) for path in watch], stall_s)
        try:
            yield child
        finally:
            child.kill()


def run_while_progressing(
    command: Sequence[str],
    *,
    watch: Iterable[str | Path] = (),
    stall_s: float = STALL_S,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True)` bounded by progress instead of a timeout:
    the child may run as long as its stdout, its stderr or anything under `watch` keeps changing. A stalled
    child is killed with everything in its process group."""
    with spawn(command, watch=watch, stall_s=stall_s, env=env, cwd=cwd) as child:
        return child.wait()


def _read(handle) -> str:
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")
