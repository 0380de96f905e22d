"""Loading tasksets by registered id and by import path, their errors, and the EnvConfig source block."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from pydantic import ValidationError

import tandem.envs.registry
from tandem.envs import EnvConfig, Taskset, load_env, load_taskset, register_taskset, registered_tasksets
from tandem.envs.builtin.arithmetic import Arithmetic
from tandem.envs.builtin.guess_number import GuessNumber

USER_MODULE = """
from tandem.envs import Task, Taskset, reward

class Echo(Taskset):
    def __init__(self, word: str = "hi") -> None:
        self.word = word

    def tasks(self):
        return [Task(idx=0, prompt=f"say {self.word}", answer=self.word)]

    @reward
    def same(self, completion, answer):
        return completion == answer

class NoReward(Taskset):
    def tasks(self):
        return []

NOT_A_CLASS = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's taskset module on sys.path, and a registry that this test may change freely."""
    (tmp_path / "user_tasks_mod.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tandem.envs.registry, "_REGISTRY", dict(tandem.envs.registry._REGISTRY))
    yield "user_tasks_mod"
    monkeypatch.delitem(__import__("sys").modules, "user_tasks_mod", raising=False)


def test_builtins_load_by_id():
    assert set(registered_tasksets()) >= {"reverse_text", "arithmetic", "gsm8k", "guess_number"}
    assert isinstance(load_taskset("arithmetic", seed=1), Arithmetic)
    assert isinstance(load_taskset("guess_number"), GuessNumber)


def test_load_by_import_path_with_args(user_module):
    echo = load_taskset(f"{user_module}:Echo", word="yo")
    assert echo.tasks()[0].answer == "yo"
    assert isinstance(load_taskset("tandem.envs.builtin.arithmetic:Arithmetic"), Arithmetic)


def test_register_an_id(user_module):
    register_taskset("echo", f"{user_module}:Echo")
    register_taskset("echo", f"{user_module}:Echo")  # the same again is fine
    assert type(load_taskset("echo")).__name__ == "Echo"
    with pytest.raises(ValueError, match="already registered"):
        register_taskset("echo", "elsewhere:Echo")
    with pytest.raises(ValueError, match="may not contain ':'"):
        register_taskset("a:b", f"{user_module}:Echo")


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        (
            "gsm8",
            ValueError,
            r"unknown taskset id 'gsm8'; did you mean 'gsm8k'\?.*registered: arithmetic, calculator, count_shapes, gsm8k",
        ),
        ("nothing_like_it", ValueError, r"unknown taskset id 'nothing_like_it'; registered: .*pkg.module:Class"),
        ("no_such_pkg.tasks:X", ImportError, r"cannot import module 'no_such_pkg.tasks'"),
        ("{mod}:Missing", ImportError, r"has no attribute 'Missing'"),
        ("{mod}:NOT_A_CLASS", TypeError, r"not a concrete subclass of tandem.envs.Taskset"),
        ("tandem.envs:Taskset", TypeError, r"not a concrete subclass"),
        ("{mod}:NoReward", TypeError, r"declares no @reward"),
        ("{mod}:", ValueError, r"must look like 'pkg.module:Class'"),
    ],
)
def test_bad_ids_and_paths_say_what_is_wrong(user_module, target, error, message):
    with pytest.raises(error, match=message):
        load_taskset(target.format(mod=user_module))


@pytest.fixture
def console_script_path(tmp_path, monkeypatch):
    """`tmp_path` as the working directory and a `sys.path` without it, as a console script (`tandem eval`) has."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)])
    yield tmp_path
    sys.modules.pop("one_file_envs", None)


def test_a_one_file_env_in_the_working_directory_loads_without_it_on_sys_path(console_script_path):
    (console_script_path / "one_file_envs.py").write_text(textwrap.dedent(USER_MODULE))
    assert load_taskset("one_file_envs:Echo", word="yo").tasks()[0].answer == "yo"
    assert sys.path[0] == str(console_script_path)  # the working directory first, as under `python -m`


def test_a_module_not_found_names_the_import_rule(console_script_path):
    with pytest.raises(ImportError) as caught:
        load_taskset("one_file_envs:Echo")
    message = str(caught.value)
    assert "No module named 'one_file_envs'" in message
    assert f"looked up in the working directory {console_script_path} first, then in installed packages" in message


def test_bad_args_list_the_accepted_ones():
    with pytest.raises(TypeError, match=r"taskset 'arithmetic': bad args \['sed'\].*it takes: seed, num_tasks"):
        load_taskset("arithmetic", sed=3)


def test_env_config_loads_from_a_toml_shaped_dict():
    config = EnvConfig.model_validate(
        {"id": "arithmetic", "args": {"num_tasks": 10}, "select": {"include": "0:4"}, "timeout_s": 30}
    )
    taskset = load_env(config)
    assert taskset.timeout_s == 30 and type(taskset).timeout_s == 300.0
    assert isinstance(taskset, Taskset)
    with pytest.raises(ValidationError, match="timeout_s"):
        EnvConfig(id="arithmetic", timeout_s=0)
    with pytest.raises(ValidationError, match="max_turns"):
        EnvConfig(id="guess_number", max_turns=0)
    with pytest.raises(ValidationError, match="selct"):
        EnvConfig.model_validate({"id": "arithmetic", "selct": {}})
    with pytest.raises(ValidationError, match=r"include\.idx"):
        EnvConfig.model_validate({"id": "arithmetic", "select": {"include": "3:1"}})


def test_every_config_field_is_documented():
    from tandem.envs import SelectConfig, TaskFilter

    for model in (EnvConfig, SelectConfig, TaskFilter):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
