"""The live progress bar and log lines share one console: a line logged while the bar is live prints above it,
never written into the bar's line (as two consoles on one terminal did)."""

from __future__ import annotations

import io
import logging
import re

from rich.console import Console

import tandem.run
from tandem.config.eval import ConcurrencyConfig
from tandem.eval.concurrency import AdaptiveLimiter, AimdController
from tandem.eval.progress import EvalProgress
from tandem.run import setup_logging


def test_log_lines_print_above_the_live_bar(monkeypatch):
    terminal = io.StringIO()
    monkeypatch.setattr(tandem.run, "_CONSOLE", Console(file=terminal, force_terminal=True, width=100))
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # setup_logging's handlers go with the test
    setup_logging("info")
    limiter = AdaptiveLimiter(AimdController(ConcurrencyConfig()))
    with EvalProgress({"gsm8k": 3}, [], limiter) as progress:
        for index in range(3):
            logging.getLogger("tandem.eval").warning("rollout %d failed", index)
            progress.add({"source": "gsm8k", "outcome": "ok", "reward": 1.0})
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue().replace("\x1b[2K", "\x00"))
    lines = [line for line in re.split(r"[\r\n\x00]", screen) if "rollout" in line]
    assert len(lines) == 3
    assert all("gsm8k" not in line and "concurrency" not in line for line in lines), lines  # no bar on a log line
