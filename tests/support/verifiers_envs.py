"""Running verifiers environments in tests: the test tasksets on the path, and a source config that runs their
agents' harnesses as local `uv` scripts (verifiers' subprocess runtime)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from support.paths import REPO
from tandem.testing.tiny import QWEN3_MARKERS

__all__ = ["LOCAL_AGENT", "QWEN3_MARKERS", "QWEN3_RENDERER", "TASKSETS", "on_path", "verifiers_table"]

TASKSETS = REPO / "tests" / "support" / "verifiers_tasksets"
QWEN3_RENDERER = {"name": "qwen3", "enable_thinking": False}
LOCAL_AGENT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
"""A seat that runs verifiers' chat program (the `null` harness) on this machine."""


def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test tasksets importable here and in every child process (`tandem rl`'s orchestrator)."""
    monkeypatch.syspath_prepend(str(TASKSETS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TASKSETS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for name in [n for n in sys.modules if n.startswith("vf_")]:
        del sys.modules[name]


def verifiers_table(*agents: str, **env: Any) -> dict[str, Any]:
    """A source's `verifiers` table with every named seat (default: the single agent) run locally, rendered by
    the Qwen3 renderer."""
    return {"env": {**{agent: LOCAL_AGENT for agent in agents or ("agent",)}, **env}, "renderer": QWEN3_RENDERER}
