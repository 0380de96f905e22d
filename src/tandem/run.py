"""The run directory and logging every command sets up before it works, and how a command's errors end."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tandem.config import ConfigError, RunConfig, to_toml
from tandem.files import atomic_write_text

logger = logging.getLogger("tandem")

RUN_CONFIG = re.compile(r"^(sft|rl|trainer|orchestrator|eval|inference(-\d+)?)\.toml$")
"""The resolved configs a tandem process writes into its run directory (`prepare_run_dir`, the launcher)."""


class RunError(RuntimeError):
    """A run that cannot go on, for a reason its message says in full (a loss that is no longer finite):
    the command prints the message, not a traceback, and exits with code 1."""

    exit_code = 1


def exit_code(name: str, body: Callable[[], int | None]) -> int:
    """Run a command's body and return its exit code. A mistake in what the user gave (`ConfigError`, 2) or a
    run that cannot go on (`RunError`, 1) ends in its message on stderr, never a traceback."""
    try:
        return int(body() or 0)
    except (ConfigError, RunError) as error:
        sys.stderr.write(f"tandem {name}: error: {error}\n")
        return error.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"tandem {name}: interrupted\n")
        return 130


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Make sure a new run never writes into an earlier run's files (it would truncate their metrics and mix
    its policies and checkpoints with theirs).

    A resumed run continues the earlier one in place. Otherwise a directory that holds anything besides
    resolved configs (`RUN_CONFIG`) and `logs/` (all a run leaves that failed before its first output) is
    refused, unless `overwrite`, which first deletes everything in it, provided it is a run's directory (it has
    a tandem config: a mistyped --output-dir must not delete a folder that merely holds a `pyproject.toml` or a
    `logs/`). Only the command that starts a run claims its directory: the processes it starts into that
    directory do not.
    """
    if resume and overwrite:
        raise ConfigError("--resume continues the run in its directory and --overwrite deletes it: give one")
    if resume or not run_dir.is_dir():
        return
    outputs = sorted(entry.name for entry in run_dir.iterdir() if not _config_or_log(entry))
    if not outputs:
        return
    shown = ", ".join(outputs[:4]) + (", ..." if len(outputs) > 4 else "")
    if not overwrite:
        raise ConfigError(
            f"{run_dir} holds an earlier run ({shown}): continue it with --resume, replace it with --overwrite "
            "(deletes it), or pick another --run-name"
        )
    if not any(RUN_CONFIG.match(entry.name) and entry.is_file() for entry in run_dir.iterdir()):
        raise ConfigError(
            f"{run_dir} holds {shown} but no tandem run config (sft.toml, rl.toml, ...), so it is not a run "
            "directory: --overwrite deletes only runs; move it or pick another --run-name"
        )
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    logger.warning("--overwrite: deleted the earlier run in %s (%s)", run_dir, ", ".join(outputs))


def _config_or_log(entry: Path) -> bool:
    return (entry.name == "logs" and entry.is_dir()) or (bool(RUN_CONFIG.match(entry.name)) and entry.is_file())


_TRACEBACK = "Traceback (most recent call last):"
_NOT_THE_FAILURE = ("Exception ignored", "Exception in thread")  # what follows is a traceback the process survived
_COMMAND_ERROR = re.compile(r"^tandem [\w-]+: (error|interrupted)")  # `exit_code`'s one line


def log_tail(path: Path, lines: int = 30) -> str:
    """The end of a child process's log, for the error that reports its death: its last `lines` lines up to the
    end of the failure (the last traceback it died of, or its command's one-line error), not the noise an
    interpreter may print after it while shutting down (a finalizer's "Exception ignored" traceback, a leaked
    semaphore warning), which would push the real exception out of view."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    logged = text.splitlines()
    end = _failure_end(logged)
    shown = "\n".join(logged[max(0, end - lines) : end]) or "(no output)"
    later = len(logged) - end
    return shown + (f"\n({later} later lines in {path})" if later else "")


def _failure_end(lines: list[str]) -> int:
    """The index after the last line of the failure a log ends with (its length when none is recognised)."""
    start = next(
        (
            i
            for i in range(len(lines) - 1, -1, -1)
            if _COMMAND_ERROR.match(lines[i])
            or (lines[i].startswith(_TRACEBACK) and not (i and lines[i - 1].startswith(_NOT_THE_FAILURE)))
        ),
        None,
    )
    if start is None:
        return len(lines)
    if not lines[start].startswith(_TRACEBACK):
        return start + 1
    end = start + 1
    while end < len(lines) and (lines[end].startswith(" ") or not lines[end]):  # the frames
        end += 1
    end = min(end + 1, len(lines))  # the exception
    while end < len(lines) and lines[end].startswith((" ", "\t")):
        end += 1  # its message's indented lines (a pydantic ValidationError's fields)
    return end


_CONSOLE: Console | None = None


def console() -> Console:
    """The process's one rich console on stderr. Log lines and every progress bar go through it, so a line
    logged while a bar is live prints above the bar instead of being written into it."""
    global _CONSOLE
    if _CONSOLE is None:
        _CONSOLE = Console(stderr=True)
    return _CONSOLE


def setup_logging(level: str, log_file: Path | None = None) -> None:
    """Rich console output on stderr (`console()`) plus, when given, a plain-text log file."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    on_console = RichHandler(console=console(), show_path=False, rich_tracebacks=False, markup=False)
    on_console.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    root.addHandler(on_console)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(file_handler)
    root.setLevel(level.upper())


def prepare_run_dir(config: RunConfig, process: str | None = None) -> Path:
    """Create `<output_dir>/<run_name>/`, write the resolved config there and start logging to `logs/`."""
    run_dir = config.run_dir
    process = process or config.command
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # output_dir is a file, or not writable
        raise ConfigError(f"cannot create the run directory {run_dir}: {error.strerror}") from None
    atomic_write_text(run_dir / f"{process}.toml", to_toml(config))
    setup_logging(config.log.level, run_dir / "logs" / f"{process}.log")
    logger.info("run directory: %s", run_dir)
    return run_dir


STOPPED_SUFFIX = ".stopped.json"
"""`<process>.stopped.json` in a run directory: that process stopped cleanly (`records_clean_stop`)."""


@contextmanager
def records_clean_stop(run_dir: Path, process: str) -> Iterator[None]:
    """Around a server's whole life: when it ends by returning or by Ctrl-C (a SIGTERM the server turns into a
    return), write `<run_dir>/<process>.stopped.json` (`{"time", "pid"}`, atomically), so a server stopped on
    purpose is told from one that died (whose heartbeat merely stops: the dashboard's `stopped` vs `failed`). An
    earlier run's marker is removed first: a server serving again in the same directory is not stopped."""
    marker = run_dir / f"{process}{STOPPED_SUFFIX}"
    marker.unlink(missing_ok=True)

    def record() -> None:
        atomic_write_text(marker, json.dumps({"time": round(time.time(), 3), "pid": os.getpid()}) + "\n")

    try:
        yield
    except KeyboardInterrupt:
        record()
        raise
    record()


def step_progress(label: str, total: int, completed: int = 0) -> tuple[Progress, int]:
    """A started rich progress bar on stderr counting steps, with a free-form `status` field."""
    progress = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console(),
    )
    task = progress.add_task(label, total=total, completed=completed, status="")
    progress.start()
    return progress, task
