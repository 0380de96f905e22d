"""The dashboard's JSON API and pages over a synthetic outputs directory."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from tandem.dashboard.server import create_app


@pytest.fixture
def client(outputs):
    return TestClient(create_app(outputs))


def test_the_run_list(client):
    runs = client.get("/api/runs").json()["runs"]
    assert {run["name"]: run["status"] for run in runs} == {
        "rl-run": "finished",
        "sft-old": "failed",
        "evals": "running",
    }


def test_metrics_split_trainer_orchestrator_and_online_evals(client):
    data = client.get("/api/runs/rl-run/metrics").json()
    assert data["steps"] == {"trainer": 5, "orchestrator": 5, "inference": 4}
    assert [r["step"] for r in data["trainer"]] == [1, 2, 3, 4, 5]
    assert [r["reward/a"] for r in data["orchestrator"]] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert data["orchestrator"][0]["staleness_mean"] == 0.25
    assert data["evals"] == [{"kind": "eval", "step": 2, "eval/a/reward": 0.5, "eval/a/pass@1": 0.5, "eval/a/ok": 4}]


def test_the_steps_a_run_resumed_from_are_kept_however_the_records_are_sampled(client, outputs):
    assert client.get("/api/runs/rl-run/metrics?max_points=2").json()["resumes"] == [3]
    assert client.get("/api/runs/sft-old/metrics").json()["resumes"] == []
    records = [
        {"step": s, "loss": 1.0, **({"resumed_from": s - 1} if s in (500, 7001) else {})} for s in range(1, 9000)
    ]
    (outputs / "sft-old" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = client.get("/api/runs/sft-old/metrics?max_points=2").json()
    assert [r["step"] for r in data["trainer"]] == [1, 8999] and data["resumes"] == [499, 7000]


def test_idle_times_come_both_per_step_and_cumulative(client):
    data = client.get("/api/runs/rl-run/metrics").json()
    assert [r["idle_s"] for r in data["trainer"]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r["idle_total_s"] for r in data["trainer"]] == [1.0, 3.0, 6.0, 10.0, 15.0]
    assert [r["inference_idle_s"] for r in data["orchestrator"]] == [1, 4, 9, 16, 25]
    assert [r["inference_idle_step_s"] for r in data["orchestrator"]] == [1, 3, 5, 7, 9]


def test_inference_heartbeats_are_charted_over_uptime(client):
    inference = client.get("/api/runs/rl-run/metrics").json()["inference"]
    assert [(r["uptime_s"], r["tokens_per_s"], r["waiting"]) for r in inference] == [
        (0.0, 100.0, 0), (5.0, 101.0, 1), (10.0, 102.0, 0), (15.0, 103.0, 1)
    ]  # fmt: skip


def test_metrics_are_downsampled(client):
    data = client.get("/api/runs/rl-run/metrics?max_points=3").json()
    assert [r["step"] for r in data["trainer"]] == [1, 3, 5]


def test_thousands_of_steps_come_back_as_at_most_max_points(client, outputs):
    path = outputs / "rl-run" / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 10_001)))
    data = client.get("/api/runs/rl-run/metrics?max_points=400").json()
    assert data["steps"]["trainer"] == 10_000
    steps = [r["step"] for r in data["trainer"]]
    assert len(steps) == 400 and steps[0] == 1 and steps[-1] == 10_000


def test_eval_summary_from_traces_while_running(client):
    data = client.get("/api/evals/evals/summary").json()
    assert data["final"] is False
    assert data["sources"]["a"]["outcomes"] == {"ok": 2, "truncated": 1, "timeout": 1, "error": 0}
    assert data["sources"]["b"]["outcomes"] == {"ok": 1, "truncated": 0, "timeout": 0, "error": 1}
    assert data["sources"]["a"]["mean_reward"] == 0.5


def test_eval_summary_prefers_summary_json(client, outputs):
    (outputs / "evals" / "summary.json").write_text('{"sources": {"a": {"rollouts": 9}}}')
    assert client.get("/api/evals/evals/summary").json() == {"final": True, "sources": {"a": {"rollouts": 9}}}


def test_samples_filter_by_outcome_and_reward_and_page(client):
    def samples(query: str) -> dict:
        return client.get(f"/api/evals/evals/samples?{query}").json()

    assert samples("")["total"] == 6
    assert [s["key"] for s in samples("outcome=ok")["samples"]] == ["k0", "k1", "k4"]
    assert [s["key"] for s in samples("min_reward=0.5")["samples"]] == ["k0", "k2", "k4"]
    assert [s["key"] for s in samples("max_reward=0.5&outcome=ok")["samples"]] == ["k1"]
    page = samples("offset=2&limit=2")
    assert (page["total"], [s["key"] for s in page["samples"]]) == (6, ["k2", "k3"])
    assert client.get("/api/evals/evals/samples?min_reward=abc").status_code == 400


def test_rl_rollouts_filter_by_step_outcome_and_reward_and_page(client):
    def samples(query: str) -> dict:
        response = client.get(f"/api/runs/rl-run/samples?{query}")
        assert response.status_code == 200, response.text
        return response.json()

    everything = samples("")
    assert everything["total"] == 10
    assert set(everything["samples"][0]) == {
        "step", "source", "task_id", "prompt", "completion", "reward", "advantage", "outcome", "version", "metrics"
    }  # fmt: skip
    assert [s["task_id"] for s in samples("step=2")["samples"]] == ["t2", "t3"]
    assert [s["task_id"] for s in samples("outcome=truncated")["samples"]] == ["t3", "t7"]
    assert [s["task_id"] for s in samples("min_reward=0.5&source=b")["samples"]] == ["t3", "t9"]
    assert [s["task_id"] for s in samples("max_reward=0.5&step=5")["samples"]] == ["t8"]
    page = samples("offset=8&limit=5")
    assert (page["total"], [s["task_id"] for s in page["samples"]]) == (10, ["t8", "t9"])
    assert samples("step=99") == {"total": 0, "samples": [], "sources": ["a", "b"]}  # sources: for the filter


def test_a_run_without_rollouts_has_no_samples(client):
    assert client.get("/api/runs/sft-old/samples").json() == {"total": 0, "samples": [], "sources": []}


@pytest.mark.parametrize(
    "url",
    [
        "/api/runs/rl-run/metrics?max_points=abc",
        "/api/runs/rl-run/metrics?max_points=1",
        "/api/runs/rl-run/metrics?max_points=99999999999999999999",
        "/api/runs/rl-run/samples?offset=-1",
        "/api/runs/rl-run/samples?offset=1e3",
        "/api/runs/rl-run/samples?limit=0",
        "/api/runs/rl-run/samples?limit=1000000",
        "/api/runs/rl-run/samples?step=abc",
        "/api/runs/rl-run/samples?step=-2",
        "/api/runs/rl-run/samples?min_reward=nan",
        "/api/runs/rl-run/samples?max_reward=inf",
        "/api/runs/rl-run/samples?min_reward=1e999",
        "/api/evals/evals/samples?limit=" + "9" * 5000,
        "/api/evals/evals/samples?max_reward=-Infinity",
    ],
)
def test_bad_query_values_are_400_naming_the_value(client, url):
    response = client.get(url)
    assert response.status_code == 400, (url, response.status_code, response.text)
    name = url.split("?")[1].split("=")[0]
    assert response.json()["error"].startswith(f"{name}: ")


def strict_json(text: str):
    """Parse as a browser does: NaN and Infinity are not JSON."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in a JSON response")

    return json.loads(text, parse_constant=refuse)


def test_nan_infinity_and_wrong_types_in_files_give_strict_json_never_a_500(client, outputs):
    rl = outputs / "rl-run"
    (rl / "metrics.jsonl").write_text(
        '{"step": 1, "loss": NaN, "grad_norm": Infinity, "entropy": -Infinity, "idle_s": "slow"}\n'
        '{"step": "two", "loss": [1, 2]}\n[1, 2, 3]\n"a string"\n123\nnull\n{"step": 3, "loss": 0.5}\n'
        + "[" * 100_000  # deeper than the parser's stack
        + "\n"
        + json.dumps(
            {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], "step": 4}
        )
        + "\n"
    )
    (rl / "orchestrator_metrics.jsonl").write_text(
        '{"step": 1, "reward": NaN, "staleness": {"x": "y"}}\n{"step": 2, "reward": "high", "staleness": [1]}\n'
    )
    (rl / "rollouts.jsonl").write_text('{"step": 1, "reward": NaN, "advantage": Infinity}\n{"step": 1, "reward": 1}\n')
    urls = (
        "/api/runs",
        "/api/runs/rl-run/metrics",
        "/api/runs/rl-run/samples",
        "/api/runs/rl-run/samples?min_reward=0",
    )
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, (url, response.text[-500:])
        strict_json(response.text)
    data = client.get("/api/runs/rl-run/metrics").json()
    assert [r["step"] for r in data["trainer"]] == [1, "two", 3, 4]
    assert (data["trainer"][0]["loss"], data["trainer"][0]["grad_norm"], data["trainer"][0]["entropy"]) == (None,) * 3
    assert data["orchestrator"][0]["reward"] is None
    rows = {row["name"]: row for row in client.get("/api/runs").json()["runs"]}
    assert rows["rl-run"]["steps"] == 4 and rows["rl-run"]["last_reward"] is None
    assert rows["rl-run"]["problems"] == ["metrics.jsonl: 5 corrupt lines skipped"]
    assert client.get("/api/runs/rl-run/samples?min_reward=0").json()["total"] == 1


def test_a_corrupt_eval_trace_is_skipped_and_a_repeated_one_counted_once(client, outputs):
    path = outputs / "evals" / "traces.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + '{"source": "a", "outcome": "ok", "reward": "x"}\n{"outcome": NaN}\n' + "".join(lines))
    summary = client.get("/api/evals/evals/summary")
    assert summary.status_code == 200, summary.text
    assert summary.json()["sources"]["a"]["rollouts"] == 4
    (row,) = [r for r in client.get("/api/runs").json()["runs"] if r["name"] == "evals"]
    assert row["steps"] == 6
    assert row["problems"] == [
        "traces.jsonl: 2 incomplete trace records skipped", "traces.jsonl: 1 repeated rollouts counted once"
    ]  # fmt: skip


def test_a_corrupt_summary_json_falls_back_to_the_traces(client, outputs):
    for text in ("{not json", '{"sources": [1, 2]}', "[]", '{"sources": {"a": null}}', "[" * 100_000):
        (outputs / "evals" / "summary.json").write_text(text)
        response = client.get("/api/evals/evals/summary")
        assert response.status_code == 200, (text, response.text)
        assert response.json()["final"] is False and response.json()["sources"]["a"]["rollouts"] == 4
    (outputs / "evals" / "summary.json").write_text('{"sources": {"a": {"mean_reward": NaN, "rollouts": 9}}}')
    response = client.get("/api/evals/evals/summary")
    assert strict_json(response.text) == {"final": True, "sources": {"a": {"mean_reward": None, "rollouts": 9}}}


def test_symlinked_runs_and_files_pointing_outside_are_not_served(client, outputs, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "eval.toml").write_text("")
    (outside / "secret.jsonl").write_text('{"step": 1, "password": "hunter2", "reward": 1.0}\n')
    (outside / "traces.jsonl").write_text((outputs / "evals" / "traces.jsonl").read_text())
    (outputs / "escape").symlink_to(outside, target_is_directory=True)
    rl = outputs / "rl-run"
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (rl / name).unlink()
        (rl / name).symlink_to(outside / "secret.jsonl")
    (outputs / "evals" / "traces.jsonl").unlink()
    (outputs / "evals" / "traces.jsonl").symlink_to(outside / "traces.jsonl")
    for url in ("/api/evals/escape/samples", "/api/evals/escape/summary", "/api/runs/escape/metrics", "/eval/escape"):
        assert client.get(url).status_code in (200, 404), url
    for url in ("/api/evals/escape/samples", "/api/evals/escape/summary", "/api/runs/escape/metrics"):
        assert client.get(url).status_code == 404, url
    assert "escape" not in {run["name"] for run in client.get("/api/runs").json()["runs"]}
    for url in ("/api/runs/rl-run/metrics", "/api/runs/rl-run/samples", "/api/evals/evals/samples", "/api/runs"):
        response = client.get(url)
        assert response.status_code == 200 and "hunter2" not in response.text and "question" not in response.text, url
    assert client.get("/api/runs/rl-run/metrics").json()["steps"]["trainer"] == 0
    assert client.get("/api/evals/evals/samples").json()["total"] == 0


def test_unknown_and_traversing_names_are_404(client):
    for url in ("/api/runs/missing/metrics", "/api/runs/not-a-run/metrics", "/api/runs/..%2F..%2Fetc/metrics"):
        assert client.get(url).status_code == 404, url


def test_pages_and_static_files_are_served(client):
    for url, text in [("/", "tandem runs"), ("/run/rl-run", 'data-page="run"'), ("/eval/evals", 'data-page="eval"')]:
        response = client.get(url)
        assert response.status_code == 200 and text in response.text
    assert "drawChart" in client.get("/static/app.js").text
    assert client.get("/static/style.css").status_code == 200
