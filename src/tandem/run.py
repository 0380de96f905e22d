"""The run directory and logging every command sets up before it works."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tandem.config import RunConfig, to_toml

logger = logging.getLogger("tandem")


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def keep_steps_up_to(path: Path, step: int) -> None:
    """Rewrite a per-step JSONL file without the records past `step` (and any half-written line), so a
    run resumed from step `step`'s checkpoint never counts a later step twice."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line half-written when the process was killed
        if record.get("step", 0) <= step:
            kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a child process's log, for the error that reports its death."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def setup_logging(level: str, log_file: Path | None = None) -> None:
    """Rich console output on stderr plus, when given, a plain-text log file."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False, markup=False)
    console.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    root.addHandler(console)
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
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / f"{process}.toml", to_toml(config))
    setup_logging(config.log.level, run_dir / "logs" / f"{process}.log")
    logger.info("run directory: %s", run_dir)
    return run_dir


def step_progress(label: str, total: int, completed: int = 0) -> tuple[Progress, int]:
    """A started rich progress bar on stderr counting steps, with a free-form `status` field."""
    progress = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    task = progress.add_task(label, total=total, completed=completed, status="")
    progress.start()
    return progress, task
