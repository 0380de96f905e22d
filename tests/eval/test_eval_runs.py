"""`tandem eval` end to end against the fake server: files, counts, outcomes, retries, concurrency."""

from __future__ import annotations

import itertools
import json
import re
import textwrap
from collections import Counter
from pathlib import Path

from tandem.cli import main
from tandem.envs.builtin.gsm8k import PROMPT, parse_gsm8k_answer
from tandem.eval.traces import read_traces, trace_key

TRACE_FIELDS = {
    "key", "source", "task", "rollout", "prompt", "completion", "reward", "metrics", "outcome", "error",
    "tokens", "latency_s", "turns", "attempts", "model", "sampling", "finished_at", "concurrency",
}  # fmt: skip


def run_eval(tmp_path: Path, server, *argv: str, name: str = "run") -> tuple[int, Path]:
    common = ["--base-url", f"{server.url}/v1", "--output-dir", str(tmp_path), "--run-name", name]
    return main(["eval", *argv, *common, "--env.retries.backoff-s", "0.001"]), tmp_path / name


def summaries(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["sources"]


def test_gsm8k_from_the_shared_file_end_to_end(tmp_path, fake_server, gsm8k_path, capsys):
    rows = [json.loads(line) for line in gsm8k_path.read_text().splitlines()[:6]]
    solutions = {PROMPT.format(question=row["question"]): row["answer"] for row in rows}
    right = set(list(solutions)[::2])  # the server knows every other answer
    fake_server.answer = lambda m: solutions[m[-1]["content"]] if m[-1]["content"] in right else "No idea."
    code, run_dir = run_eval(
        tmp_path, fake_server, "gsm8k",
        "--env.args", f"{{path = {json.dumps(str(gsm8k_path))}}}",
        "--env.select.limit", "6", "--env.rollouts-per-task", "2", "--env.sampling.seed", "7",
    )  # fmt: skip
    assert code == 0
    assert (run_dir / "eval.toml").is_file() and (run_dir / "logs" / "eval.log").is_file()
    records = read_traces(run_dir / "traces.jsonl")
    assert len(records) == 12 and all(set(r) == TRACE_FIELDS for r in records)
    assert Counter((r["task"]["id"], r["rollout"]) for r in records) == Counter(
        {(f"gsm8k-test-{i}", k): 1 for i in range(6) for k in range(2)}
    )
    for r in records:
        assert r["key"] == trace_key("gsm8k", r["task"]["id"], r["rollout"])
        assert r["prompt"][0]["content"] in solutions and r["outcome"] == "ok" and r["model"] == "fake-model"
        assert r["sampling"] == {"max_tokens": 1024, "temperature": 1.0, "top_p": 1.0, "seed": 7 + r["rollout"]}
        assert r["reward"] == float(r["prompt"][0]["content"] in right) == r["metrics"]["correct"]
        assert r["task"]["answer"] == parse_gsm8k_answer(solutions[r["prompt"][0]["content"]])
        assert r["tokens"]["completion"] > 0 and r["latency_s"] > 0
    summary = summaries(run_dir)["gsm8k"]
    assert summary["tasks"] == 6 and summary["rollouts"] == 12 and summary["missing"] == 0
    assert summary["outcomes"] == {"ok": 12, "truncated": 0, "timeout": 0, "error": 0}
    assert summary["mean_reward"] == 0.5 and summary["pass_at_k"] == {"1": 0.5, "2": 0.5}
    assert set(summary["latency_s"]) == {"p50", "p90", "p99"}
    assert "pass@2" in capsys.readouterr().out


def reverse_or_wrong(messages) -> str:
    """Reverses reverse_text phrases exactly; gets every arithmetic question wrong."""
    text = messages[-1]["content"]
    return text.rsplit("\n\n", 1)[1][::-1] if text.startswith("Reverse") else "-1"


def test_two_sources_give_two_summaries(tmp_path, fake_server, capsys):
    fake_server.answer = reverse_or_wrong
    sources = tmp_path / "sources.toml"
    sources.write_text(
        textwrap.dedent("""
            [env]
            sampling = { max_tokens = 64 }

            [[source]]
            id = "reverse_text"
            args = { num_tasks = 3 }
            rollouts_per_task = 2

            [[source]]
            id = "arithmetic"
            name = "maths"
            args = { num_tasks = 4 }
            sampling = { temperature = 0.0 }
        """)
    )
    code, run_dir = run_eval(tmp_path, fake_server, "@", str(sources))
    assert code == 0
    result = summaries(run_dir)
    assert list(result) == ["reverse_text", "maths"]
    assert result["reverse_text"]["rollouts"] == 6 and result["reverse_text"]["mean_reward"] == 1.0
    assert result["maths"]["rollouts"] == 4 and result["maths"]["mean_reward"] == 0.0
    assert result["maths"]["pass_at_k"] == {"1": 0.0}
    by_source = Counter(r["source"] for r in read_traces(run_dir / "traces.jsonl"))
    assert by_source == {"reverse_text": 6, "maths": 4}
    out = capsys.readouterr().out
    assert "reverse_text" in out and "maths" in out


def test_slow_requests_time_out_and_the_concurrency_shrinks(tmp_path, fake_server):
    calls = itertools.count()
    fake_server.delay = lambda messages: 60.0 if next(calls) % 3 == 0 else 0.0  # every third request stalls
    code, run_dir = run_eval(
        tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 12}",
        "--env.request-timeout-s", "2", "--env.retries.max-retries", "0",
        "--concurrency.initial", "4", "--concurrency.max", "4",
    )  # fmt: skip
    assert code == 0
    records = read_traces(run_dir / "traces.jsonl")
    timeouts = [r for r in records if r["outcome"] == "timeout"]
    assert len(timeouts) == 4 and all(r["reward"] == 0.0 and "2s" in r["error"] for r in timeouts)
    assert records[0]["concurrency"] == 4 and min(r["concurrency"] for r in records) < 4
    summary = summaries(run_dir)["arithmetic"]
    assert summary["outcomes"]["timeout"] == 4 and summary["rollouts"] == 12


def test_a_rollout_past_its_own_deadline_is_a_timeout(tmp_path, fake_server):
    fake_server.delay = lambda messages: 0.3
    code, run_dir = run_eval(
        tmp_path, fake_server, "reverse_text", "--env.args", "{num_tasks = 2}", "--env.timeout-s", "0.05"
    )
    assert code == 0
    assert [r["outcome"] for r in read_traces(run_dir / "traces.jsonl")] == ["timeout", "timeout"]


def test_500s_are_retried_as_configured(tmp_path, fake_server):
    fake_server.fail_next(3, status=500)
    code, run_dir = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 5}",
                             "--env.retries.max-retries", "3", "--concurrency.initial", "1")  # fmt: skip
    assert code == 0
    records = read_traces(run_dir / "traces.jsonl")
    assert [r["outcome"] for r in records] == ["ok"] * 5
    assert sum(r["attempts"] for r in records) == 5 + 3 == len(fake_server.requests)


def test_a_source_with_only_errors_fails_the_eval(tmp_path, fake_server):
    fake_server.status_always = 500
    code, run_dir = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 3}",
                             "--env.retries.max-retries", "2")  # fmt: skip
    assert code == 1
    records = read_traces(run_dir / "traces.jsonl")
    assert all(r["outcome"] == "error" and r["attempts"] == 3 and "HTTP 500" in r["error"] for r in records)
    assert len(fake_server.requests) == 9
    assert summaries(run_dir)["arithmetic"]["outcomes"]["error"] == 3


def test_a_reply_cut_at_max_tokens_is_truncated(tmp_path, fake_server):
    code, run_dir = run_eval(tmp_path, fake_server, "reverse_text", "--env.args", "{num_tasks = 2, min_words = 3}",
                             "--env.sampling.max-tokens", "2")  # fmt: skip
    assert code == 0
    records = read_traces(run_dir / "traces.jsonl")
    assert [r["outcome"] for r in records] == ["truncated", "truncated"]
    assert summaries(run_dir)["reverse_text"]["outcomes"]["truncated"] == 2


def bisect(messages) -> str:
    """Plays guess_number perfectly: binary search over the replies so far."""
    low, high = 1, 100
    for guess, reply in zip(messages[1::2], messages[2::2], strict=False):
        number = int(re.findall(r"\d+", guess["content"])[0])
        low, high = (number + 1, high) if reply["content"] == "higher" else (low, number - 1)
    return str((low + high) // 2)


def test_a_multi_turn_env_runs_through_the_same_loop(tmp_path, fake_server):
    fake_server.answer = bisect
    code, run_dir = run_eval(tmp_path, fake_server, "guess_number", "--env.args", "{num_tasks = 3}")
    assert code == 0
    records = read_traces(run_dir / "traces.jsonl")
    assert all(r["outcome"] == "ok" and r["metrics"]["solved"] == 1.0 for r in records)
    assert all(r["turns"] == len(r["completion"]) // 2 + 1 == r["metrics"]["guesses"] for r in records)
    assert summaries(run_dir)["guess_number"]["pass_at_k"] == {"1": 1.0}


def test_an_unreachable_server_fails_the_eval_before_its_directory_exists(tmp_path, fake_server, capsys):
    fake_server.stop()
    code, run_dir = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 1}",
                             "--env.retries.max-retries", "0")  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"tandem eval: error: the server at {fake_server.url}/v1 cannot be evaluated: ")
    assert "GET /v1/models: ConnectError" in err[-1]
    assert not run_dir.exists()  # a refused eval leaves no run that looks failed


def test_a_model_the_server_does_not_serve_is_refused_before_any_rollout(tmp_path, fake_server, capsys):
    code, _ = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 3}", "--model", "my-model")
    assert code == 2
    assert fake_server.requests == []  # no rollout was sent to a model that is not there
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"tandem eval: error: --model 'my-model': {fake_server.url}/v1 does not serve it; "
        "it serves 'fake-model' (GET /v1/models)"
    )
    assert not (tmp_path / "run").exists()  # refused before its directory was created
    code, run_dir = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 3}",
                             "--model", "fake-model")  # fmt: skip
    assert code == 0 and len(read_traces(run_dir / "traces.jsonl")) == 3


def test_a_server_without_a_model_list_is_evaluated_with_the_model_given(tmp_path, fake_server, capsys):
    fake_server.models_status = 404
    code, _ = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 2}", "--model", "m")
    assert code == 0
    assert [request["model"] for request in fake_server.requests] == ["m", "m"]
    assert "cannot check --model 'm'" in capsys.readouterr().err  # checked before the run directory exists


def test_a_small_server_queue_does_not_hold_the_concurrency_down(tmp_path, fake_server):
    fake_server.delay = lambda messages: 0.05
    depths = itertools.cycle([0, 1, 0, 2, 1, 0, 3])  # a saturated batching server's queue: a few, varying
    fake_server.queue_depth = lambda: next(depths)
    # latency is left out (a huge tolerance): on a loaded machine this in-process server slows down with load
    code, run_dir = run_eval(tmp_path, fake_server, "arithmetic", "--env.args", "{num_tasks = 200}",
                             "--concurrency.initial", "4", "--concurrency.max", "32",
                             "--concurrency.latency-tolerance", "1000")  # fmt: skip
    assert code == 0
    concurrency = [r["concurrency"] for r in read_traces(run_dir / "traces.jsonl")]
    assert len(concurrency) == 200 and concurrency[0] == 4 and max(concurrency) == 32


def calls_then_answers(messages):
    """A model that calls the calculator on the question, then answers with the tool's result."""
    if messages[-1]["role"] == "tool":
        return f"The product is {messages[-1]['content']}"
    a, b = re.findall(r"\d+", messages[-1]["content"])[:2]
    call = {"name": "calculate", "arguments": {"expression": f"{a} * {b}"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_a_tool_env_sends_its_tools_and_traces_every_call_and_result(tmp_path, fake_server):
    fake_server.answer = calls_then_answers
    code, run_dir = run_eval(tmp_path, fake_server, "calculator", "--env.args", "{num_tasks = 2}",
                             "--env.sampling.max-tokens", "64")  # fmt: skip
    assert code == 0
    assert all(request["tools"][0]["function"]["name"] == "calculate" for request in fake_server.requests)
    records = read_traces(run_dir / "traces.jsonl")
    assert len(records) == 2
    for record in records:
        assistant, tool, final = record["completion"]
        assert "<tool_call>" in assistant["content"] and tool["role"] == "tool" and tool["name"] == "calculate"
        assert final["content"] == f"The product is {record['task']['answer']}"
        assert record["reward"] == 1.0 and record["turns"] == 2
        assert record["metrics"] == {"correct": 1.0, "used_tool": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
