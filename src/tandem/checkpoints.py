"""Where a run's training checkpoints are, for every process that looks for them.

`<run>/checkpoints/step-<N>/` is complete once it holds `state.json` (`tandem.trainer.ckpt` writes it under a
temporary name and renames it). The launcher picks the one to resume from and the orchestrator keeps a resume
point for each one kept; they find them here, beside the trainer rather than inside it.
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def list_checkpoints(root: Path) -> dict[int, Path]:
    """Complete checkpoints under root, by step, oldest first."""
    if not root.is_dir():
        return {}
    found = {}
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / "state.json").is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))
