"""A verifiers source's tasks and config: tandem picks exactly the tasks `vf-eval` picks for the same `select`
(both through verifiers' `Taskset.select`), and a bad source is a one-line error before anything starts."""

from __future__ import annotations

import os
import subprocess

import pytest

from support.verifiers_envs import TASKSETS, on_path, verifiers_table
from tandem.config import ConfigError
from tandem.config.orchestrator import OrchestratorConfig, TrainSourceConfig
from tandem.envs.verifiers import VerifiersEnv, uv_environment, wheels_dir
from tandem.orchestrator.tasks import check_sources

vf = pytest.importorskip("verifiers.v1", reason="needs the verifiers extra")

SELECT = {
    "include": {"idx": "0:14"},
    "exclude": {"names": ["word-1"], "idx": [3]},
    "shuffle": True,
    "seed": 5,
    "skip": 1,
    "limit": 6,
}


def test_select_picks_the_tasks_vf_eval_picks(monkeypatch):
    on_path(monkeypatch)
    config = TrainSourceConfig(id="vf_letters", verifiers=verifiers_table(taskset={"num_tasks": 20}), select=SELECT)
    tasks = VerifiersEnv.load("vf_letters", config).select(config.select)
    # what `vf-eval vf_letters --select.* ...` runs: verifiers' own env, its own SelectConfig, its own views
    env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "vf_letters", "num_tasks": 20}}))
    reference = vf.SelectConfig(
        include={"idx": ["0:14"]}, exclude={"names": ["word-1"], "idx": [3]}, shuffle=True, seed=5, skip=1, limit=6
    )
    expected = [task.data.idx for task in env.taskset.select(reference)]
    assert [task.idx for task in tasks] == expected
    assert len(expected) == 6 and expected != sorted(expected)  # shuffled, and the filters did something
    assert not {1, 3, 5, 9, 13} & set(expected)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ({"id": "vf_nonexistent", "verifiers": {}}, "vf_nonexistent"),
        ({"id": "vf_letters", "verifiers": verifiers_table(), "args": {"n": 1}}, "verifiers.env.taskset"),
        ({"id": "vf_letters", "verifiers": verifiers_table(), "max_turns": 3}, "max_turns"),
        ({"id": "vf_letters", "verifiers": {"env": {"taskset": {"id": "other"}}}}, "differs from the source id"),
        ({"id": "vf_letters", "verifiers": {"env": {"agent": {"harness": {"id": "no_such_harness"}}}}}, "harness"),
    ],
)
def test_a_bad_verifiers_source_is_a_one_line_error(monkeypatch, tmp_path, source, words):
    on_path(monkeypatch)
    config = OrchestratorConfig(source=[source])
    with pytest.raises(ConfigError, match=words) as raised:
        check_sources(config)
    assert "\n" not in str(raised.value)


def test_harness_programs_install_from_the_wheelhouse_alone(tmp_path, monkeypatch):
    for name in ("UV_DEFAULT_INDEX", "UV_FIND_LINKS", "UV_PYTHON_DOWNLOADS", "UV_PYTHON", "UV_COMPILE_BYTECODE"):
        monkeypatch.delenv(name, raising=False)
    assert uv_environment(tmp_path) == {"UV_COMPILE_BYTECODE": "1"}  # no wheels: uv resolves from its index
    (tmp_path / "openai-2.0.0-py3-none-any.whl").write_bytes(b"")
    env = uv_environment(tmp_path)
    assert env["UV_DEFAULT_INDEX"] == tmp_path.as_uri() and env["UV_FIND_LINKS"] == str(tmp_path)
    assert env["UV_PYTHON_DOWNLOADS"] == "never"
    monkeypatch.setenv("UV_FIND_LINKS", "/elsewhere")
    assert "UV_FIND_LINKS" not in uv_environment(tmp_path)  # a user's own setting wins


def test_verifiers_chat_program_installs_with_no_network(tmp_path):
    """What verifiers' subprocess runtime runs to install its chat program (`uv sync --script`), under tandem's
    variables, with every connection sent to a dead proxy: it installs from the wheelhouse or fails."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    wheels = wheels_dir()
    if not any(wheels.glob("*.whl")):
        pytest.skip(f"no wheelhouse at {wheels}: run `tandem verifiers-wheels`")
    script = tmp_path / "chat.py"
    script.write_text(CHAT_PROGRAM_SOURCE)
    dead = "http://127.0.0.1:9"
    env = {**os.environ, **uv_environment(), "UV_CACHE_DIR": str(tmp_path / "cache"), "HTTP_PROXY": dead,
           "HTTPS_PROXY": dead, "ALL_PROXY": dead, "UV_OFFLINE": "false"}  # fmt: skip
    env.pop("NO_PROXY", None)
    command = ["uv", "sync", "--script", str(script), "-q", "--no-config"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_online_eval_source_is_checked_like_a_training_source(monkeypatch):
    on_path(monkeypatch)
    eval_source = {"name": "letters", "id": "vf_letters", "verifiers": verifiers_table()}
    check_sources(OrchestratorConfig(source=[{"id": "reverse_text"}], eval={"source": [eval_source]}))
    broken = {**eval_source, "verifiers": {"env": {"agent": {"harness": {"id": "no_such_harness"}}}}}
    with pytest.raises(ConfigError, match=r"source .letters.: .*harness"):
        check_sources(OrchestratorConfig(source=[{"id": "reverse_text"}], eval={"source": [broken]}))


def test_a_toolsets_module_is_put_where_verifiers_child_process_finds_it(monkeypatch, tmp_path):
    """verifiers starts a Toolset as `python -m <module>` in a child process: the module's directory (here found
    through sys.path alone, as a one-file env beside the command is) goes onto PYTHONPATH."""
    on_path(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", "")
    VerifiersEnv.load("vf_tools", TrainSourceConfig(id="vf_tools", verifiers=verifiers_table()))
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(TASKSETS)]


def test_a_toolset_module_that_starts_no_server_is_refused_before_any_rollout(monkeypatch, tmp_path):
    module = tmp_path / "vf_silent_tools.py"
    tools = (TASKSETS / "vf_tools.py").read_text()
    module.write_text(tools[: tools.index('if __name__ == "__main__":')])
    on_path(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = TrainSourceConfig(id="vf_silent_tools", verifiers=verifiers_table())
    with pytest.raises(ValueError, match=r"toolset AddToolset: .*python -m vf_silent_tools.*AddToolset\.run\(\)"):
        VerifiersEnv.load("vf_silent_tools", config)
