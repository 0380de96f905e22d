"""`tandem inference` as a process: port 0 and server.json, the admin token from its environment, the serving
summary, SIGTERM (recorded as a clean stop), config mistakes and a port in use (before the model loads), and
`tandem eval --model` running against it end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from support.jsonl import read_jsonl
from support.servers import taken_port
from tandem.cli import main
from tandem.dashboard.listing import list_runs
from tandem.dashboard.runs import Outputs
from tandem.inference import main as inference_main
from tandem.jsonl import read_records
from tandem.testing.progress import tree_state, wait_for


def test_the_server_process_publishes_its_port_and_stops_on_sigterm(model_dir, tmp_path):
    command = [
        sys.executable, "-m", "tandem", "inference", "--model", str(model_dir("qwen3")), "--model.dtype", "float32",
        "--port", "0", "--seq-len", "128", "--output-dir", str(tmp_path), "--run-name", "srv", "--log-interval-s", "0.2",
    ]  # fmt: skip
    env = {**os.environ, "TANDEM_ADMIN_TOKEN": "from-env"}  # how `tandem rl` gives its servers the run's token
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        server_json = tmp_path / "srv" / "server.json"
        wait_for(lambda: server_json.is_file() or process.poll() is not None, lambda: tree_state([tmp_path]))
        assert process.poll() is None, process.communicate()[1]
        info = json.loads(server_json.read_text())
        assert info["pid"] == process.pid and info["model"] == model_dir("qwen3").name
        assert httpx.get(f"{info['url']}/health").json()["status"] == "ok"
        assert httpx.post(f"{info['url']}/pause").status_code == 401
        admin = {"Authorization": "Bearer from-env"}
        assert httpx.post(f"{info['url']}/pause", headers=admin).json()["paused"] is True
        assert httpx.post(f"{info['url']}/resume", headers=admin).json()["paused"] is False
        # on a GPU the first request captures the decode graphs and autotunes the kernels: seconds, not httpx's 5
        reply = httpx.post(f"{info['url']}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        metrics = tmp_path / "srv" / "inference_metrics.jsonl"

        def summarised() -> bool:
            records = read_records(metrics)
            return len(records) >= 2 and sum(r["requests"] for r in records) >= 1

        wait_for(lambda: summarised() or process.poll() is not None)
        assert process.poll() is None, "the server exited before its serving summary"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert f"tandem inference listening on {info['url']}" in out
    log = (tmp_path / "srv" / "logs" / "inference.log").read_text()
    assert "serving: " in log and "tokens/s" in log
    assert json.loads((tmp_path / "srv" / "inference.stopped.json").read_text())["pid"] == process.pid
    assert [(row["name"], row["status"]) for row in list_runs(Outputs(tmp_path))] == [("srv", "stopped")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/dir"], "not a local directory"),
        ([], "no model to serve"),
        (["--host", "0.0.0.0"], "--admin-token"),
        (["--seq-len", "100000"], "max_position_embeddings"),
    ],
)
def test_config_mistakes_exit_2_with_a_message(argv, message, model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    model = [] if argv[:1] == ["--model"] or not argv else ["--model", str(model_dir("qwen3"))]
    assert main(["inference", *model, *argv, "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_port_in_use_exits_2_in_one_line_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(inference_main, "load_served_model", load)
    with taken_port() as port:
        argv = ["inference", "--model", str(model_dir("qwen3")), "--port", str(port), "--output-dir", str(tmp_path)]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"tandem inference: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert list(tmp_path.iterdir()) == []  # nothing written: not even the run directory


def test_tandem_eval_runs_against_the_built_in_server(model_dir, tmp_path):
    argv = [
        "eval", "arithmetic", "--env.args", "{num_tasks = 3}", "--env.sampling.max-tokens", "8",
        "--model", str(model_dir("qwen3")), "--model.dtype", "float32", "--seq-len", "256",
        "--output-dir", str(tmp_path), "--run-name", "ev", "--startup-timeout-s", "120",
    ]  # fmt: skip
    assert main(argv) == 0
    records = read_jsonl(tmp_path / "ev" / "traces.jsonl")
    assert len(records) == 3
    assert all(r["outcome"] in ("ok", "truncated") and r["tokens"]["completion"] > 0 for r in records), records
