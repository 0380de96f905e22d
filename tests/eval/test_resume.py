"""Killing an eval with SIGKILL, then `--resume`: every rollout once; a changed config is refused; a second
eval in a run directory in use is refused; the resumed run takes its server and sources from its saved config."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter

from support.fake_openai import FakeServer
from tandem.cli import main
from tandem.eval.traces import read_traces
from tandem.testing.progress import spawn

TASKS, ROLLOUTS = 20, 2


def eval_argv(server_url: str) -> list[str]:
    return [
        "reverse_text", "--base-url", server_url, "--env.args", f"{{num_tasks = {TASKS}}}",
        "--env.rollouts-per-task", str(ROLLOUTS), "--concurrency.initial", "2", "--concurrency.max", "2",
    ]  # fmt: skip


def test_kill_9_then_resume_runs_each_rollout_exactly_once(tmp_path, fake_server, capsys):
    fake_server.delay = lambda messages: 0.05  # 40 rollouts, 2 at a time: about a second of work
    run_dir = tmp_path / "ev"
    traces = run_dir / "traces.jsonl"
    command = [sys.executable, "-m", "tandem", "eval", *eval_argv(fake_server.url)]
    with spawn([*command, "--output-dir", str(tmp_path), "--run-name", "ev"], watch=[run_dir]) as process:
        process.wait_until(lambda: len(read_traces(traces)) >= 6, "6 traces")
        fake_server.delay = lambda messages: 0.5  # the first eval has seconds left while a second one tries
        assert main(["eval", *eval_argv(fake_server.url), "--resume", str(run_dir)]) == 2
        assert not process.ended()
        assert f"{run_dir} is in use by another eval (pid {process.pid})" in capsys.readouterr().err
        assert process.kill() == -signal.SIGKILL
    before = read_traces(traces)
    assert 6 <= len(before) < TASKS * ROLLOUTS
    with open(traces, "a") as handle:
        handle.write('{"key": "half-written by a dying writ')  # as if killed mid-line

    # A fresh server counts the resumed run's requests alone: one the killed eval had sent may still arrive
    # at the first (the server is not part of what a resumed eval must keep).
    with FakeServer() as server:
        assert main(["eval", *eval_argv(server.url), "--resume", str(run_dir)]) == 0
    assert len(server.requests) == TASKS * ROLLOUTS - len(before)  # only what was missing
    after = read_traces(traces)
    assert after[: len(before)] == before
    counts = Counter((r["source"], r["task"]["id"], r["rollout"]) for r in after)
    expected = {("reverse_text", f"reverse_text-0-{i}", k) for i in range(TASKS) for k in range(ROLLOUTS)}
    assert set(counts) == expected and set(counts.values()) == {1}
    assert len({r["key"] for r in after}) == TASKS * ROLLOUTS
    assert '"key": "half-written' not in traces.read_text()
    assert "rollouts" in capsys.readouterr().out


def test_ctrl_c_says_what_was_saved_and_how_to_resume(tmp_path, fake_server):
    fake_server.delay = lambda messages: 0.05
    run_dir = tmp_path / "ev"
    traces = run_dir / "traces.jsonl"
    command = [sys.executable, "-m", "tandem", "eval", *eval_argv(fake_server.url)]
    with spawn([*command, "--output-dir", str(tmp_path), "--run-name", "ev"], watch=[run_dir]) as process:
        process.wait_until(lambda: len(read_traces(traces)) >= 4, "4 traces")
        os.kill(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        result = process.wait()
    assert result.returncode == 130
    saved = len(read_traces(traces))
    assert 4 <= saved < TASKS * ROLLOUTS
    assert "interrupted: " in result.stderr and result.stderr.endswith("tandem eval: interrupted\n")
    log = (run_dir / "logs" / "eval.log").read_text()  # the same line, unwrapped
    assert f"interrupted: {saved} of {TASKS * ROLLOUTS} rollouts are saved in {traces}; " in log
    assert f"continue with `tandem eval --resume {run_dir}`" in log
    assert main(["eval", "--resume", str(run_dir)]) == 0  # the command it printed
    assert len(read_traces(traces)) == TASKS * ROLLOUTS


def test_a_resumed_eval_says_where_it_resumes(tmp_path, fake_server, caplog):
    argv = ["eval", "arithmetic", "--base-url", fake_server.url, "--env.args", "{num_tasks = 3}"]
    assert main([*argv, "--output-dir", str(tmp_path), "--run-name", "ev"]) == 0
    traces = tmp_path / "ev" / "traces.jsonl"
    traces.write_text(traces.read_text().splitlines(keepends=True)[0])  # as if killed after one rollout
    assert main(["eval", "--resume", str(tmp_path / "ev")]) == 0
    assert (
        f"resuming {tmp_path / 'ev'}: 1 of 3 rollouts done, 2 to run"
        in (tmp_path / "ev" / "logs" / "eval.log").read_text()
    )


def test_resume_refuses_a_changed_config_and_a_fresh_run_refuses_an_old_dir(tmp_path, fake_server, capsys):
    argv = ["arithmetic", "--base-url", fake_server.url, "--env.args", "{num_tasks = 2}"]
    assert main(["eval", *argv, "--output-dir", str(tmp_path), "--run-name", "ev"]) == 0
    capsys.readouterr()
    run_dir = str(tmp_path / "ev")
    assert main(["eval", *argv, "--env.sampling.temperature", "0.5", "--resume", run_dir]) == 2
    err = capsys.readouterr().err
    assert "the config differs" in err and "source[0].sampling.temperature: 1.0 in the run, 0.5 now" in err
    assert main(["eval", *argv, "--output-dir", str(tmp_path), "--run-name", "ev"]) == 2
    assert f"--resume {run_dir}" in capsys.readouterr().err
    assert main(["eval", *argv, "--resume", str(tmp_path)]) == 2
    assert "not an eval run directory" in capsys.readouterr().err
    assert main(["eval", *argv, "--concurrency.max", "9", "--resume", run_dir]) == 0  # how it runs may change
    assert len(read_traces(tmp_path / "ev" / "traces.jsonl")) == 2


def test_resume_alone_takes_the_server_and_sources_from_the_run(tmp_path, fake_server):
    sources = tmp_path / "sources.toml"
    sources.write_text('[[source]]\nid = "arithmetic"\nargs = { num_tasks = 3 }\n\n[concurrency]\ninitial = 1\n')
    argv = ["eval", "@", str(sources), "--base-url", f"{fake_server.url}/v1", "--model", fake_server.model]
    assert main([*argv, "--output-dir", str(tmp_path), "--run-name", "ev"]) == 0
    run_dir = tmp_path / "ev"
    traces = run_dir / "traces.jsonl"
    kept = traces.read_text().splitlines(keepends=True)[:1]
    traces.write_text("".join(kept))  # as if killed after the first rollout
    assert main(["eval", "@", str(sources), "--resume", str(run_dir)]) == 0  # the README's command
    assert len(fake_server.requests) == 3 + 2
    traces.write_text("".join(kept))
    assert main(["eval", "--resume", str(run_dir)]) == 0
    assert len(fake_server.requests) == 3 + 2 + 2
    assert all(request["model"] == fake_server.model for request in fake_server.requests)
    assert len(read_traces(traces)) == 3


def test_repeated_and_corrupt_trace_lines_count_once(tmp_path, fake_server):
    argv = ["eval", "arithmetic", "--base-url", fake_server.url, "--env.args", "{num_tasks = 4}"]
    assert main([*argv, "--output-dir", str(tmp_path), "--run-name", "ev"]) == 0
    run_dir = tmp_path / "ev"
    traces = run_dir / "traces.jsonl"
    first, second, *_ = traces.read_text().splitlines(keepends=True)
    failed = json.loads(second) | {"outcome": "error", "reward": 0.0}
    with open(traces, "a") as handle:  # a second writer appended copies of rollouts already there
        handle.write(first + json.dumps(failed) + "\n" + "{not json}\n")
    requests = len(fake_server.requests)
    assert main([*argv, "--resume", str(run_dir)]) == 0
    assert len(fake_server.requests) == requests  # nothing was missing
    log = (run_dir / "logs" / "eval.log").read_text()
    assert "traces.jsonl: skipped 1 corrupt line(s) (line 7)" in log
    assert "traces.jsonl: skipped 2 line(s) repeating a rollout already read (line 5, 6)" in log
    summary = json.loads((run_dir / "summary.json").read_text())["sources"]["arithmetic"]
    assert summary["rollouts"] == 4 and summary["outcomes"]["error"] == 0
