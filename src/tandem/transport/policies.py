"""Policy versions as Hugging Face checkpoint directories (the `file` weight transport, and every run's final
policy).

Policy N (the weights after trainer step N) lives in `<run>/policies/step-<N>/`, written whole by `save_model`
(temporary directory, then rename) and then marked complete by a `COMPLETE` file, so a reader that sees the
marker sees the whole checkpoint. `prune_policies` removes the ones no server will load again.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

COMPLETE = "COMPLETE"
_STEP = re.compile(r"^step-(\d+)$")


def policy_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def mark_complete(path: Path) -> None:
    (path / COMPLETE).write_text("")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).exists()


def _steps(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := _STEP.match(p.name))}


def latest_policy(root: Path) -> int:
    """The newest complete policy version (0 if none: the initial weights)."""
    return max((step for step, path in _steps(root).items() if is_complete(path)), default=0)


def prune_policies(root: Path, served: int) -> list[int]:
    """Delete the policy directories older than `served`, the version every server serves now: a server only
    ever loads the newest complete one, so none will load them again (`served` and anything newer stay, so does
    the final policy, never older than what is served). Returns the versions deleted."""
    gone = sorted(step for step in _steps(root) if step < served)
    for step in gone:
        shutil.rmtree(policy_dir(root, step), ignore_errors=True)
    return gone
