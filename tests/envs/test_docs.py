"""docs/environments.md: its complete example environment loads by import path and scores as the page says."""

from __future__ import annotations

import asyncio
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.envs import EnvConfig, apply_select, load_env

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    """The page's example written out as `my_pkg/capitals.py`."""
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "capitals.py").write_text(blocks("python")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_pkg.capitals", "my_pkg"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_example_environment_scores_as_documented(my_pkg):
    config = EnvConfig(id="my_pkg.capitals:Capitals", select={"limit": 1})
    taskset = load_env(config)
    (task,) = apply_select(taskset, config.select)
    score = asyncio.run(taskset.score(task, "Paris, of course."))
    assert score.reward == pytest.approx(1.1)
    assert score.metrics == {"correct": 1.0, "initial": 1.0, "words": 3.0}
    assert "Score(reward=1.1, metrics={'correct': 1.0, 'initial': 1.0, 'words': 3.0})" in blocks("python")[1]


def test_example_toml_configs_validate(my_pkg):
    source, select = (tomllib.loads(b) for b in blocks("toml"))
    config = EnvConfig.model_validate(source["env"])
    assert [t.answer for t in apply_select(load_env(config), config.select)] == ["Tokyo"]
    EnvConfig.model_validate({"id": "gsm8k", **select["env"]})
