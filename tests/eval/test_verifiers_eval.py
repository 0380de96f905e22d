"""`tandem eval` on a verifiers environment: verifiers' own harness (its chat program, a `uv` script) evaluates the
server through verifiers' eval client, each episode scored by the taskset's own reward; the run picks exactly the
tasks `vf-eval` picks for the same `select`, and a killed eval `--resume`s with nothing run twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from support.fake_openai import FakeServer
from support.verifiers_envs import on_path
from tandem.cli import main
from tandem.config.eval import EvalSourceConfig
from tandem.envs.verifiers import uv_environment
from tandem.eval.traces import read_traces
from tandem.testing.progress import spawn

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra")

SELECT = """shuffle = true
seed = 5
skip = 1
limit = 6
[{table}.include]
idx = ["0:14"]
[{table}.exclude]
names = ["word-1"]
idx = [3]
"""
"""A `select` that shuffles, skips, limits and filters by name and index: the parity test's."""

AGENT = 'harness = { id = "null" }\nruntime = { type = "subprocess" }\n'


def _sources(tmp_path: Path, num_tasks: int, rollouts: int, select: str = "") -> Path:
    """A one-source eval config: vf_letters with `num_tasks` tasks, run by a local chat program."""
    path = tmp_path / "eval.toml"
    path.write_text(
        f'[[source]]\nid = "vf_letters"\nrollouts_per_task = {rollouts}\n'
        "sampling = { max_tokens = 8, seed = 3 }\n"
        f"[source.verifiers.env.taskset]\nnum_tasks = {num_tasks}\n"
        f"[source.verifiers.env.agent]\n{AGENT}"
        + (f"[source.select]\n{select.format(table='source.select')}" if select else "")
    )
    return path


def _letter_e(idx: int) -> float:
    """The reward of task `idx` when the server echoes its prompt (the fake server does)."""
    text = f"Write word {idx}."
    return text.count("e") / len(text)


def test_eval_of_a_verifiers_env_scores_each_rollout_by_the_tasksets_reward(tmp_path, fake_server, monkeypatch):
    on_path(monkeypatch)
    config = _sources(tmp_path, num_tasks=5, rollouts=2)
    argv = ["eval", "@", str(config), "--base-url", fake_server.url, "--output-dir", str(tmp_path), "--run-name", "ev"]
    assert main(argv) == 0
    records = read_traces(tmp_path / "ev" / "traces.jsonl")
    assert Counter((r["task"]["idx"], r["rollout"]) for r in records) == {(i, k): 1 for i in range(5) for k in range(2)}
    for record in records:
        assert record["outcome"] == "ok", record["error"]
        assert record["reward"] == pytest.approx(_letter_e(record["task"]["idx"]))
        assert record["metrics"] == {"reply_chars": float(len(f"Write word {record['task']['idx']}."))}
        assert record["prompt"] == [{"role": "user", "content": f"Write word {record['task']['idx']}."}]
        assert [m["role"] for m in record["completion"]] == ["assistant"] and record["turns"] == 1
    # verifiers' eval client streamed each request with the source's sampling, rollout k seeded seed + k
    assert len(fake_server.requests) == 10 and all(r["stream"] and r["max_tokens"] == 8 for r in fake_server.requests)
    assert Counter(r["seed"] for r in fake_server.requests) == {3: 5, 4: 5}
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())["sources"]["vf_letters"]
    assert summary["mean_reward"] == pytest.approx(sum(_letter_e(i) for i in range(5)) / 5)


def test_a_failing_server_is_a_counted_error_outcome_not_a_crash(tmp_path, fake_server, monkeypatch):
    on_path(monkeypatch)
    fake_server.status_always = 400  # verifiers does not retry a 400: each episode fails once
    config = _sources(tmp_path, num_tasks=2, rollouts=1)
    argv = ["eval", "@", str(config), "--base-url", fake_server.url, "--output-dir", str(tmp_path), "--run-name", "ev"]
    assert main(argv) == 1  # every rollout of the source failed
    records = read_traces(tmp_path / "ev" / "traces.jsonl")
    assert [r["outcome"] for r in records] == ["error", "error"] and all(r["reward"] == 0.0 for r in records)
    assert all("scripted 400" in r["error"] for r in records), [r["error"] for r in records]


def test_eval_picks_the_tasks_vf_eval_picks(tmp_path, fake_server, monkeypatch):
    on_path(monkeypatch)
    config = _sources(tmp_path, num_tasks=20, rollouts=1, select=SELECT)
    argv = ["eval", "@", str(config), "--base-url", fake_server.url, "--output-dir", str(tmp_path), "--run-name", "ev"]
    assert main(argv) == 0
    ours = [r["task"]["idx"] for r in read_traces(tmp_path / "ev" / "traces.jsonl")]

    # `vf-eval` itself, on the same taskset config and select, against the same server
    reference = tmp_path / "vf.toml"
    reference.write_text(
        f'model = "{fake_server.model}"\nnum_rollouts = 1\npush = false\noutput_dir = "{tmp_path / "vf"}"\n'
        f'[run]\ndir = "parity"\n[client]\ntype = "eval"\nbase_url = "{fake_server.url}/v1"\n'
        '[env.taskset]\nid = "vf_letters"\nnum_tasks = 20\n'
        f"[env.agent]\n{AGENT}[select]\n{SELECT.format(table='select')}"
    )
    command = [sys.executable, "-c", "from verifiers.v1.cli.eval.main import main; main()", "@", str(reference)]
    done = subprocess.run(
        [*command, "--rich", "None"],
        env={**os.environ, **uv_environment()},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "vf" / "parity" / "traces.jsonl") as lines:
        theirs = [json.loads(line)["task"]["data"]["idx"] for line in lines]
    assert len(ours) == 6 and sorted(ours) == sorted(theirs)  # vf-eval writes in completion order
    assert not {1, 3, 5, 9, 13} & set(ours)  # the filters did something


def test_a_killed_verifiers_eval_resumes_with_every_rollout_once(tmp_path, fake_server, monkeypatch):
    on_path(monkeypatch)
    tasks, rollouts = 8, 2
    fake_server.delay = lambda messages: 0.2
    config = _sources(tmp_path, num_tasks=tasks, rollouts=rollouts)
    run_dir = tmp_path / "ev"
    traces = run_dir / "traces.jsonl"
    flags = ["--concurrency.initial", "2", "--concurrency.max", "2"]
    command = [sys.executable, "-m", "tandem", "eval", "@", str(config), "--base-url", fake_server.url, *flags]
    with spawn([*command, "--output-dir", str(tmp_path), "--run-name", "ev"], watch=[run_dir]) as process:
        process.wait_until(lambda: len(read_traces(traces)) >= 3, "3 traces")
        assert process.kill() == -signal.SIGKILL
    before = read_traces(traces)
    assert 3 <= len(before) < tasks * rollouts

    with FakeServer() as server:  # counts the resumed run's requests alone
        assert main(["eval", "--resume", str(run_dir), "--base-url", server.url]) == 0
    assert len(server.requests) == tasks * rollouts - len(before)
    after = read_traces(traces)
    assert after[: len(before)] == before
    assert Counter((r["task"]["idx"], r["rollout"]) for r in after) == {
        (i, k): 1 for i in range(tasks) for k in range(rollouts)
    }
    assert all(r["outcome"] == "ok" for r in after)


def test_a_two_agent_eval_scores_the_trainable_agent_and_names_each_agents_messages(tmp_path, fake_server, monkeypatch):
    on_path(monkeypatch)
    config = tmp_path / "duo.toml"
    config.write_text(
        '[[source]]\nid = "vf_duo"\nsampling = { max_tokens = 8 }\n'
        f"[source.verifiers.env.solver]\n{AGENT}[source.verifiers.env.critic]\n{AGENT}"
    )
    argv = ["eval", "@", str(config), "--base-url", fake_server.url, "--output-dir", str(tmp_path), "--run-name", "ev"]
    assert main(argv) == 0
    records = read_traces(tmp_path / "ev" / "traces.jsonl")
    assert len(records) == 4 and all(r["outcome"] == "ok" for r in records)
    for record in records:  # the critic is not trainable: the solver's reward alone, its messages alone
        assert record["reward"] == pytest.approx(_letter_e(record["task"]["idx"]))
        assert [m["role"] for m in record["completion"]] == ["assistant"]
    assert len(fake_server.requests) == 8  # both agents sampled


def test_tools_of_a_toolset_run_in_their_own_server_and_their_results_reach_the_model(
    tmp_path, fake_server, monkeypatch
):
    on_path(monkeypatch)

    def call_add(body: dict) -> tuple[str, dict] | None:
        """A tool call on the first turn (the sum the prompt asks for), text once the tool has answered."""
        if body["messages"][-1]["role"] != "user":
            return None
        a, b = map(int, re.findall(r"\d+", body["messages"][-1]["content"]))
        return body["tools"][0]["function"]["name"], {"a": a, "b": b}

    fake_server.call_tool = call_add
    fake_server.answer = lambda messages: f"The sum is {_text(messages[-1]['content'])}."
    config = tmp_path / "tools.toml"
    config.write_text(
        f'[[source]]\nid = "vf_tools"\nsampling = {{ max_tokens = 16 }}\n[source.verifiers.env.taskset]\n'
        f"num_tasks = 2\n[source.verifiers.env.agent]\n{AGENT}"
    )
    argv = ["eval", "@", str(config), "--base-url", fake_server.url, "--output-dir", str(tmp_path), "--run-name", "ev"]
    assert main(argv) == 0
    records = read_traces(tmp_path / "ev" / "traces.jsonl")
    assert len(records) == 2
    for record in records:
        idx = record["task"]["idx"]
        assert record["outcome"] == "ok" and record["reward"] == 1.0, record
        assert record["metrics"]["tool_results"] == 1.0 and record["turns"] == 2
        assistant, tool, final = record["completion"]
        assert assistant["tool_calls"][0]["function"]["name"].endswith("add")
        assert tool["role"] == "tool" and _text(tool["content"]) == str(2 * idx + 2)  # the tool server's sum
        assert final == {"role": "assistant", "content": f"The sum is {2 * idx + 2}."}
    tools = fake_server.requests[0]["tools"]
    assert [t["function"]["description"] for t in tools] == ["Add two integers and return their sum."]


def _text(content: str | list) -> str:
    """A message's text, whether a string or content parts."""
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def test_the_eval_pages_verifiers_source_is_a_valid_source(monkeypatch):
    page = (Path(__file__).resolve().parents[2] / "docs" / "eval.md").read_text()
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", page, re.DOTALL) if "[source.verifiers" in b]
    (source,) = tomllib.loads(block)["source"]
    config = EvalSourceConfig.model_validate(source)
    assert config.verifiers is not None and config.verifiers.env["agent"]["runtime"] == {"type": "subprocess"}
    assert config.rollouts_per_task == 4 and config.select.limit == 50
