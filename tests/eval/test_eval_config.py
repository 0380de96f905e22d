"""The eval config: `[env]` flowing into `[[source]]` blocks, the positional env id, flags, round trips."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tandem.cli import COMMANDS
from tandem.config import ConfigError, load_config, load_file, to_toml
from tandem.config.eval import EvalConfig
from tandem.envs import EnvConfig, apply_select, load_env
from tandem.eval.resume import config_differences
from tandem.eval.runner import load_source

SOURCES = """
    [env]
    rollouts_per_task = 2
    sampling = { temperature = 0.7, max_tokens = 64 }
    retries = { max_retries = 5 }

    [[source]]
    id = "arithmetic"
    args = { num_tasks = 20 }
    select = { include = { idx = "0:10" }, shuffle = true, seed = 3, limit = 4 }

    [[source]]
    id = "reverse_text"
    name = "reverse-long"
    args = { num_tasks = 6, min_words = 4 }
    sampling = { temperature = 0.0 }
"""


def load(tmp_path, text: str, *argv: str) -> EvalConfig:
    path = tmp_path / "sources.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(EvalConfig, ["@", str(path), *argv])[0]


def test_sources_inherit_env_key_by_key(tmp_path):
    config = load(tmp_path, SOURCES, "--env.retries.max-retries", "3")
    arithmetic, reverse = config.source
    assert (arithmetic.name, reverse.name) == ("arithmetic", "reverse-long")
    assert arithmetic.rollouts_per_task == reverse.rollouts_per_task == 2
    assert arithmetic.sampling.temperature == 0.7 and reverse.sampling.temperature == 0.0
    assert reverse.sampling.max_tokens == 64  # tables merge: the source's sampling keeps env's max_tokens
    assert config.env.retries.max_retries == 3  # the spelling: --env.retries.max-retries


def test_a_positional_env_id_is_the_one_source():
    argv = ["gsm8k", "--env.select.limit", "5", "--model", "some/dir"]
    config, _ = load_config(EvalConfig, [f"--{COMMANDS['eval'].positional}", *argv])
    [source] = config.source
    assert (source.id, source.name, source.select.limit) == ("gsm8k", "gsm8k", 5)
    assert config.model.name == "some/dir"


def test_no_source_is_a_valid_config_but_nothing_to_run():
    assert load_config(EvalConfig, [])[0].source == []


def test_source_names_must_be_unique(tmp_path):
    with pytest.raises(ConfigError, match=r"source names must be unique; \['arithmetic'\]"):
        load(tmp_path, '[[source]]\nid = "arithmetic"\n[[source]]\nid = "arithmetic"\n')


def test_unknown_source_key_names_file_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key `source\.1\.rollouts` .*sources\.toml:4"):
        load(tmp_path, '[[source]]\nid = "a"\n[[source]]\nrollouts = 2\n')


def test_dry_run_output_loads_back_equal(tmp_path):
    config = load(tmp_path, SOURCES)
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(to_toml(config))
    assert load_file(EvalConfig, resolved) == config


def test_the_same_select_picks_the_same_tasks_for_eval_and_training(tmp_path):
    """An eval [[source]] and a training [env] (a plain EnvConfig) with one select block: one task list."""
    config = load(tmp_path, SOURCES)
    eval_source = load_source(config.source[0])
    training = EnvConfig.model_validate(config.source[0].model_dump(include={"id", "args", "select"}))
    training_tasks = apply_select(load_env(training), training.select)
    assert [t.id for t in eval_source.tasks] == [t.id for t in training_tasks]
    assert eval_source.tasks == training_tasks and len(training_tasks) == 4
    assert [t.idx for t in training_tasks] != sorted(t.idx for t in training_tasks)  # shuffled, identically


def test_an_infinite_source_must_be_bounded():
    config, _ = load_config(EvalConfig, ["--env.id", "arithmetic"])
    with pytest.raises(ConfigError, match=r"infinite; bound it with select\.limit"):
        load_source(config.source[0])


def test_differences_name_every_key_except_how_the_eval_runs(tmp_path):
    saved = load(tmp_path, SOURCES)
    same = load(tmp_path, SOURCES, "--run-name", "other", "--concurrency.max", "8", "--env.retries.max-retries", "9")
    assert config_differences(saved, same) == []
    changed = load(tmp_path, SOURCES, "--env.sampling.temperature", "0.2", "--model", "other-model")
    assert config_differences(saved, changed) == [
        "env.sampling.temperature: 0.7 in the run, 0.2 now",
        "model.name: '' in the run, 'other-model' now",
        "source[0].sampling.temperature: 0.7 in the run, 0.2 now",
    ]


def test_the_example_config_loads():
    example = Path(__file__).resolve().parents[2] / "examples" / "eval" / "gsm8k.toml"
    config = load_config(EvalConfig, ["@", str(example)])[0]
    assert [s.name for s in config.source] == ["gsm8k", "arithmetic-greedy"]
    assert [s.rollouts_per_task for s in config.source] == [4, 1]
    assert config.source[1].sampling.top_p == 0.95  # from [env], under the source's own temperature
