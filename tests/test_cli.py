"""The `tandem` command line: help, version, dry-run, exit codes, the run directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tandem import __version__
from tandem.cli import COMMANDS, main
from tandem.config import load_file
from tandem.config.schema import field_kind, kebab
from tandem.config.sft import SftConfig
from tandem.testing.progress import run_while_progressing


def tandem(*args: str) -> subprocess.CompletedProcess:
    return run_while_progressing([sys.executable, "-m", "tandem", *args])


def leaf_flags(model, prefix=""):
    """Every settable leaf key of a config model, as `--dotted.kebab` flags."""
    for name, info in model.model_fields.items():
        kind = field_kind(info.annotation)
        if kind.model is not None:
            yield from leaf_flags(kind.model, f"{prefix}{kebab(name)}.")
        elif kind.list_of_model is None:
            yield f"--{prefix}{kebab(name)}", info


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tandem {__version__}"


def test_overview_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("rl", "sft", "eval", "inference", "orchestrator", "trainer", "dashboard"):
        assert f"  {name} " in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_lists_every_field_with_type_default_and_description(capsys, name):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    config_class = COMMANDS[name].config_class()
    lines = out.splitlines()
    for flag, info in leaf_flags(config_class):
        matches = [i for i, line in enumerate(lines) if line.split() and line.split()[0] == flag]
        assert matches, f"{flag} missing from `tandem {name} --help`"
        row = lines[matches[0]]
        assert "(default:" in row, row
        assert info.description, f"{flag} has no description"
        assert info.description in lines[matches[0] + 1]


def test_help_shows_the_defaults_a_section_field_declares(capsys):
    """`ckpt = CheckpointConfig(interval=50)` in the RL trainer: its help says 50, not the class's 0."""
    main(["rl", "--help"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")}
    assert rows["--trainer.ckpt.interval"].endswith("(default: 50)")
    assert rows["--trainer.optim.lr"].endswith("(default: 1e-06)")
    assert rows["--inference.port"].endswith("(default: 0)")
    assert rows["--trainer.run-name"].endswith('(default: "")')  # shared values flow from the top level


def test_help_groups_fields_by_section(capsys):
    main(["rl", "--help"])
    out = capsys.readouterr().out
    for header in ("[general]", "[trainer]", "[trainer.optim]", "[orchestrator]", "[inference]"):
        assert header in out


def test_eval_takes_only_the_model_keys_a_server_reads(capsys):
    """Nothing trains in `tandem eval`: its help lists no training key, and setting one is refused."""
    main(["eval", "--help"])
    flags = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip().startswith("--")}
    assert {"--model.name", "--model.revision", "--model.dtype", "--model.attn-backend"} <= flags
    trainer_only = ("--model.freeze-router", "--model.expert-parallel", "--model.lora.")
    assert not [flag for flag in flags if flag.startswith(trainer_only)]
    main(["sft", "--help"])
    assert "--model.lora.rank" in capsys.readouterr().out  # the training commands keep them
    assert main(["eval", "gsm8k", "--model.lora.rank", "8", "--dry-run"]) == 2
    assert "model.lora" in capsys.readouterr().err


def test_sft_dry_run_prints_merged_config(tmp_path):
    config_file = tmp_path / "some.toml"
    config_file.write_text(
        textwrap.dedent("""
        seq_len = 1024
        [optim]
        lr = 1e-4
        weight_decay = 0.1
    """)
    )
    result = tandem("sft", "--dry-run", "@", str(config_file), "--optim.lr", "3e-6")
    assert result.returncode == 0, result.stderr
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(result.stdout)
    config = load_file(SftConfig, resolved)
    assert config.optim.lr == 3e-6 and config.optim.weight_decay == 0.1 and config.seq_len == 1024


def test_user_errors_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlrr = 1\n")
    for args in (("sft", "@", str(bad)), ("sft", "--optim.lr", "x"), ("sft", "@", "missing.toml"), ("sfd",)):
        result = tandem(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert "error" in result.stderr or "unknown command" in result.stderr


def test_unreadable_and_nonsensical_configs_exit_2_with_one_line(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "latin1.toml").write_bytes('run_name = "caf\xe9"\n'.encode("latin-1"))
    (tmp_path / "deep.toml").write_text("seed = " + "[" * 5000 + "]" * 5000)
    (tmp_path / "inf.toml").write_text("[optim]\nlr = inf\n")
    for args in (
        ("sft", "@", str(tmp_path / "dir.toml")),
        ("rl", "@", str(tmp_path / "latin1.toml")),
        ("eval", "@", str(tmp_path / "deep.toml")),
        ("sft", "@", str(tmp_path / "inf.toml")),
        ("trainer", "--optim.lr", "-inf"),
        ("inference", "--log-interval-s", "inf"),
    ):
        result = tandem(*args, "--dry-run")
        assert result.returncode == 2, (args, result.stderr)
        assert result.stdout == "" and result.stderr.count("\n") == 1, (args, result.stderr)
        assert result.stderr.startswith(f"tandem {args[0]}: error: "), result.stderr


def test_prepare_run_dir_writes_config_and_log(tmp_path):
    import logging

    from tandem.run import prepare_run_dir

    config = SftConfig(output_dir=tmp_path, run_name="exp")
    run_dir = prepare_run_dir(config)
    logging.getLogger("tandem.test").info("hello from the test")
    assert run_dir == tmp_path / "exp"
    assert load_file(SftConfig, run_dir / "sft.toml") == config
    for handler in logging.getLogger().handlers:
        handler.flush()
    assert "hello from the test" in (run_dir / "logs" / "sft.log").read_text()
    assert not list(run_dir.glob(".*.tmp"))
