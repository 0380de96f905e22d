"""docs/environments.md: its complete example environment loads by import path and scores as the page says."""

from __future__ import annotations

import asyncio
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.config.orchestrator import OnlineEvalConfig, TrainSourceConfig
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
    source, select, verifiers = (tomllib.loads(b) for b in blocks("toml"))
    config = EnvConfig.model_validate(source["env"])
    assert [t.answer for t in apply_select(load_env(config), config.select)] == ["Tokyo"]
    EnvConfig.model_validate({"id": "gsm8k", **select["env"]})
    (training,) = verifiers["orchestrator"]["source"]
    assert TrainSourceConfig.model_validate(training).verifiers.env["agent"]["runtime"] == {"type": "subprocess"}
    (online,) = OnlineEvalConfig.model_validate(verifiers["orchestrator"]["eval"]).source
    assert online.verifiers is not None and online.select.limit == 64


def test_the_one_file_tool_environment_runs_an_episode(tmp_path, monkeypatch):
    """The page's tool environment, as `my_tools/lookup.py`: a failing call, a call and its answer, the reply
    scored."""
    from tandem.envs import run_episode

    (source,) = [b for b in blocks("python") if "class Lookup(ToolTaskset)" in b]
    package = tmp_path / "my_tools"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lookup.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        taskset = load_env(EnvConfig(id="my_tools.lookup:Lookup"))
        task = taskset.tasks()[1]
        replies = iter(
            [
                '<tool_call>\n{"name": "capital", "arguments": {"country": "Atlantis"}}\n</tool_call>',
                '<tool_call>\n{"name": "capital", "arguments": {"country": "Japan"}}\n</tool_call>',
                "It is Tokyo.",
            ]
        )

        async def generate(messages):
            return next(replies)

        episode = asyncio.run(run_episode(taskset, task, generate))
    finally:
        for name in ("my_tools.lookup", "my_tools"):
            sys.modules.pop(name, None)
    tools = [m["content"] for m in episode.completion if m["role"] == "tool"]
    assert tools == ["no entry for 'Atlantis'", "Tokyo"]
    assert episode.score.reward == 1.0
    assert episode.score.metrics == {"correct": 1.0, "tool_calls": 2.0, "tool_errors": 1.0}
