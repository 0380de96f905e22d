"""`tandem sft` checks every path it reads before it loads anything: one line and exit 2 for each mistake."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch.distributed as dist

import tandem.trainer.sft as sft
from tandem.cli import main


@pytest.fixture
def no_model_build(monkeypatch):
    """Fail the test if the run gets as far as building the model."""

    def build(*args, **kwargs):
        raise AssertionError("the model was built before the mistake was found")

    monkeypatch.setattr(sft, "build_training", build)
    yield
    if dist.is_initialized():  # a run that got past its input checks joined a group of one
        dist.destroy_process_group()


def broken_copy(tiny_model_dir, tmp_path, remove=(), config_json=None):
    model = shutil.copytree(tiny_model_dir("qwen3"), tmp_path / "model")
    for name in remove:
        (model / name).unlink()
    if config_json is not None:
        (model / "config.json").write_text(config_json)
    return model


def sft_error(capsys, tmp_path, model, data, *extra):
    capsys.readouterr()  # what building the fixtures printed
    code = main(["sft", "--model", str(model), "--data.path", str(data), "--output-dir", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines()[-1].startswith("tandem sft: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ({"model": "missing"}, r"model.name .*missing: no such directory"),
        ({"model": "file"}, r"model.name .*config.json is not a directory \(a config.json alone needs random_init"),
        ({"remove": ["config.json"]}, r"model.name .*model: no config.json"),
        ({"config_json": "{not json"}, r"model.name .*model: "),
        ({"config_json": '{"architectures": ["GPT2LMHeadModel"]}'}, r"unsupported architecture 'GPT2LMHeadModel'"),
        ({"remove": ["model.safetensors"]}, r"model.name .*model holds no weights \(\*.safetensors\).*random_init"),
        ({"remove": ["tokenizer.json"]}, r"model.name .*model holds no tokenizer \(none of tokenizer.json"),
        ({"data": "missing.jsonl"}, r"data.path .*missing.jsonl: no such file"),
        ({"data": "folder"}, r"data.path .*folder is not a file"),
    ],
    ids=lambda value: "-".join(map(str, value.values())) if isinstance(value, dict) else None,
)
def test_a_bad_input_path_fails_before_anything_is_loaded_or_written(
    tiny_model_dir, reverse_text_jsonl, tmp_path, capsys, no_model_build, breakage, expected
):
    model = broken_copy(tiny_model_dir, tmp_path, breakage.get("remove", ()), breakage.get("config_json"))
    model = {"missing": tmp_path / "missing", "file": model / "config.json"}.get(breakage.get("model"), model)
    (tmp_path / "folder").mkdir()
    data = tmp_path / breakage["data"] if "data" in breakage else reverse_text_jsonl
    err = sft_error(capsys, tmp_path, model, data)
    assert len(err.splitlines()) == 1 and re.search(expected, err), err
    assert not (tmp_path / "out").exists()  # no run directory for a run that never started


def test_bad_rows_fail_before_the_model_is_built(tiny_model_dir, tmp_path, capsys, no_model_build):
    data = tmp_path / "rows.jsonl"
    good = {"prompt": "abc", "completion": "cba"}
    data.write_bytes(json.dumps(good).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    err = sft_error(capsys, tmp_path, tiny_model_dir("qwen3"), data, "--data.on-bad-row", "fail")
    assert "row 2: not UTF-8 text" in err.splitlines()[-1]


def test_chat_rows_need_a_chat_template(tiny_model_dir, reverse_text_jsonl, tmp_path, capsys, no_model_build):
    model = broken_copy(tiny_model_dir, tmp_path)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    err = sft_error(capsys, tmp_path, model, reverse_text_jsonl)
    assert "chat `messages` rows, but the model's tokenizer has no chat template" in err.splitlines()[-1]


def test_rl_checks_the_model_path_before_starting_any_process(tmp_path, capsys):
    capsys.readouterr()
    sources = tmp_path / "sources.toml"
    sources.write_text('[[orchestrator.source]]\nid = "reverse_text"\n')  # sources are checked first
    code = main(["rl", "--model", str(tmp_path / "missing"), "@", str(sources), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "model.name" in err and "no such directory" in err, err
    assert not (tmp_path / "out").exists()
