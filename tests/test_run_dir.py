"""A new run never destroys or mixes with an earlier one in the same run directory."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support.jsonl import read_metrics
from support.runs import tandem_sft, write_rl_sources
from tandem.cli import main
from tandem.config import ConfigError, load_config, to_toml
from tandem.config.rl import RlConfig
from tandem.config.sft import SftConfig
from tandem.run import claim_run_dir, prepare_run_dir


def earlier_run(run_dir):
    """What a finished run leaves: its config, logs, metrics, checkpoints and policies."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "sft.log").write_text("old log\n")
    (run_dir / "sft.toml").write_text("max_steps = 3\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run_dir / "policies" / "step-000007").mkdir(parents=True)
    (run_dir / "policies" / "step-000007" / "COMPLETE").write_text("")
    return run_dir


def test_a_directory_holding_an_earlier_run_is_refused_and_left_as_it_was(tmp_path):
    run_dir = earlier_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl, policies\).*--resume.*--overwrite"):
        claim_run_dir(run_dir, resume=False, overwrite=False)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    assert (run_dir / "policies" / "step-000007" / "COMPLETE").is_file()


def test_overwrite_deletes_the_earlier_run_and_resume_keeps_it(tmp_path):
    run_dir = earlier_run(tmp_path / "run")
    claim_run_dir(run_dir, resume=True, overwrite=False)
    assert (run_dir / "metrics.jsonl").is_file()
    with pytest.raises(ConfigError, match="give one"):
        claim_run_dir(run_dir, resume=True, overwrite=True)
    claim_run_dir(run_dir, resume=False, overwrite=True)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []


def test_overwrite_deletes_only_a_run_directory(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(ConfigError, match="not a run directory"):
        claim_run_dir(folder, resume=False, overwrite=True)
    assert (folder / "cat.jpg").read_bytes() == b"\xff\xd8"


def test_overwrite_spares_a_folder_with_some_toml_and_logs(tmp_path):
    """A project folder (a `pyproject.toml`, a `logs/`) is no run directory: refused, and --overwrite deletes nothing."""
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\n")
    (project / "train.py").write_text("print('mine')\n")
    with pytest.raises(ConfigError, match="holds an earlier run"):
        claim_run_dir(project, resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="not a run directory"):
        claim_run_dir(project, resume=False, overwrite=True)
    assert sorted(p.name for p in project.iterdir()) == ["logs", "pyproject.toml", "train.py"]


def test_a_new_missing_or_never_started_directory_is_free(tmp_path):
    claim_run_dir(tmp_path / "missing", resume=False, overwrite=False)
    started = tmp_path / "failed-at-startup"  # a run that failed before its first output: config and logs only
    (started / "logs").mkdir(parents=True)
    (started / "sft.toml").write_text("")
    claim_run_dir(started, resume=False, overwrite=False)
    assert (started / "sft.toml").is_file()


@pytest.mark.parametrize("config_class", [SftConfig, RlConfig], ids=lambda c: c.__name__)
def test_overwrite_is_never_saved_with_the_config(config_class):
    config, _ = load_config(config_class, ["--overwrite"])
    assert config.overwrite
    assert "overwrite" not in to_toml(config)  # rerunning from the run's saved config cannot delete it


@pytest.mark.parametrize("command", ["sft", "rl"])
def test_sft_and_rl_refuse_before_touching_the_earlier_run(tmp_path, tiny_model_dir, capsys, command):
    run_dir = earlier_run(tmp_path / "run")
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    args = [command, "--model", str(tiny_model_dir("qwen3")), "--output-dir", str(tmp_path), "--run-name", "run"]
    args += ["--data.fake"] if command == "sft" else ["@", write_rl_sources(tmp_path)]
    try:
        assert main(args) == 2
    finally:
        if dist.is_initialized():  # sft joined a group of one before it looked at the run directory
            dist.destroy_process_group()
    assert "holds an earlier run" in capsys.readouterr().err
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before


def test_sft_overwrite_replaces_the_earlier_run(tmp_path, tiny_model_dir):
    run_dir = earlier_run(tmp_path / "run")
    flags = [
        "--model", str(tiny_model_dir("qwen3")), "--data.fake", "--seq-len", "32", "--batch-size", "1",
        "--max-steps", "1", "--output-dir", str(tmp_path), "--run-name", "run",
    ]  # fmt: skip
    result = tandem_sft(*flags, "--overwrite")
    assert "deleted the earlier run" in result.stderr
    assert not (run_dir / "policies").exists()
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    assert "old log" not in (run_dir / "logs" / "sft.log").read_text()
    again = tandem_sft(*flags, check=False)  # the new run is protected in turn
    assert again.returncode == 2 and "holds an earlier run" in again.stderr


def test_an_output_dir_that_is_a_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create the run directory .*file/run: Not a directory"):
        prepare_run_dir(SftConfig(output_dir=tmp_path / "file", run_name="run"))


def test_rl_without_sources_is_a_config_error_before_anything_starts(tmp_path, tiny_model_dir, capsys):
    assert main(["rl", "--model", str(tiny_model_dir("qwen3")), "--output-dir", str(tmp_path)]) == 2
    assert "no training sources" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


SHUTDOWN_NOISE = """
import atexit, sys

class Finalized:
    def __del__(self):
        raise RuntimeError("a finalizer at shutdown")

keep = Finalized()
atexit.register(lambda: [print(f"W shutdown warning {i}", file=sys.stderr) for i in range(40)])
raise ValueError("the real failure: bad rollout")
"""


def test_log_tail_shows_the_exception_a_process_died_of_not_its_shutdown_noise(tmp_path):
    """A child dying of an exception may print a screenful after its traceback while the interpreter shuts down
    (atexit output, a finalizer's "Exception ignored" traceback): the tail ends at the real exception."""
    import subprocess
    import sys

    from tandem.run import log_tail

    log = tmp_path / "child.log"
    with log.open("w") as handle:
        subprocess.run([sys.executable, "-c", SHUTDOWN_NOISE], stdout=handle, stderr=subprocess.STDOUT, check=False)
    assert "Exception ignored" in log.read_text() and "shutdown warning 39" in log.read_text()  # the noise is there
    tail = log_tail(log, 10).splitlines()
    assert tail[0] == "Traceback (most recent call last):"
    assert tail[-2] == "ValueError: the real failure: bad rollout"
    assert tail[-1].startswith("(4") and tail[-1].endswith(f"later lines in {log})")
    assert not any("shutdown warning" in line or "finalizer" in line for line in tail)


def test_log_tail_ends_at_a_commands_one_line_error(tmp_path):
    from tandem.run import log_tail

    log = tmp_path / "child.log"
    log.write_text("loading\n" * 50 + "tandem orchestrator: error: source 'x': bad\n" + "noise\n" * 3)
    assert (
        log_tail(log, 3) == f"loading\nloading\ntandem orchestrator: error: source 'x': bad\n(3 later lines in {log})"
    )
    log.write_text("one\ntwo\n")
    assert log_tail(log) == "one\ntwo"  # no failure recognised: the end of the log
