"""The run directory and logging every command sets up before it works."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tandem.config import RunConfig, to_toml
from tandem.files import atomic_write_text

logger = logging.getLogger("tandem")


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
