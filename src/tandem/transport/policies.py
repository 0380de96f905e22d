"""Policy versions from the trainer to inference, as Hugging Face checkpoint directories.

Policy N (the weights after trainer step N) lives in `<run>/policies/step-<N>/`, written whole
by `save_model` (temporary directory, then rename) and then marked complete by a `COMPLETE` file,
so a reader that sees the marker sees the whole checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE = "COMPLETE"
_STEP = re.compile(r"^step-(\d+)$")


def policy_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def mark_complete(path: Path) -> None:
    (path / COMPLETE).write_text("")


def latest_policy(root: Path) -> int:
    """The newest complete policy version (0 if none: the initial weights)."""
    if not root.is_dir():
        return 0
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / COMPLETE).exists()]
    return max(steps, default=0)

