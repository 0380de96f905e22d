"""Where the files tests read live: the repository's examples and the shared data checkout beside it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
GSM8K_TEST = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
"""The shared GSM8K test split, read in place: data is never copied into the repository."""
