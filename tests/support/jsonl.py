"""Reading the JSONL record files a run wrote, and writing ones for tests to read.

Reads go through `tandem.jsonl`, the module every reader in tandem uses, strictly: a corrupt line fails the test
that reads it instead of vanishing, and a file the run never wrote fails it too (tandem's readers treat a missing
file as empty, which would turn a run that wrote nothing into a confusing assertion about empty lists).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.jsonl import read_records


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file, in order."""
    assert path.is_file(), f"{path} was never written"
    return read_records(path, strict=True)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's per-step trainer metrics (`metrics.jsonl`)."""
    return read_jsonl(run_dir / "metrics.jsonl")


def write_jsonl(path: Path, records: list[dict[str, Any]], tail: str = "") -> None:
    """`records` one a line, then `tail` as it is: a half-written last line, as a writer killed mid-line leaves."""
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + tail)
