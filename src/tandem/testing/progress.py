"""Waiting for a child process by its progress, not by the clock.

A fixed timeout fails a test on a slow or loaded machine although nothing is wrong. Tests here wait instead
for as long as the child keeps moving (its output grows, the files it writes change) and fail only when it
has stood still for a generous stall limit, which a hung child still hits.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

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


def wait_for(
    condition: Callable[[], bool],
    progress: Callable[[], object],
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


def run_while_progressing(
    command: Sequence[str],
    *,
    watch: Iterable[str | Path] = (),
    stall_s: float = STALL_S,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True)` bounded by progress instead of a timeout:
    the child may run as long as its stdout, its stderr or anything under `watch` keeps changing."""
    watched = [Path(path) for path in watch]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=cwd)

        def progress() -> tuple:
            return os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size, tree_state(watched)

        try:
            wait_for(lambda: process.poll() is not None, progress, stall_s=stall_s)
        except Stalled as error:
            process.kill()
            process.wait()
            raise Stalled(f"{list(command)}: {error}, killed; its stderr ends:\n{_read(err)[-3000:]}") from None
        return subprocess.CompletedProcess(list(command), process.returncode, _read(out), _read(err))


def _read(handle) -> str:
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")
