"""`tandem eval --model DIR` without `--base-url` starts the built-in server; a server that dies is reported.

Here the server exits before it is healthy, its model directory missing. Evals against a live built-in server run
in tests/eval/test_builtin_server_gsm8k.py and tests/inference/test_main.py.
"""

from __future__ import annotations

from tandem.cli import main


def test_a_server_that_exits_before_it_is_healthy_fails_the_eval_with_its_output(tmp_path):
    argv = ["arithmetic", "--env.args", "{num_tasks = 1}", "--model", str(tmp_path / "no-such-model")]
    assert main(["eval", *argv, "--output-dir", str(tmp_path), "--run-name", "ev", "--startup-timeout-s", "60"]) == 1
    log = (tmp_path / "ev" / "logs" / "eval.log").read_text()
    assert "the built-in inference server exited with code" in log and "inference-server.log" in log
    assert (tmp_path / "ev" / "logs" / "inference-server.log").is_file()
    assert not (tmp_path / "ev" / "traces.jsonl").exists()


def test_without_a_server_or_model_there_is_nothing_to_evaluate_against(tmp_path, capsys):
    assert main(["eval", "arithmetic", "--output-dir", str(tmp_path)]) == 2
    assert "give --model DIR" in capsys.readouterr().err
    assert main(["eval", "--base-url", "http://127.0.0.1:1", "--output-dir", str(tmp_path)]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
