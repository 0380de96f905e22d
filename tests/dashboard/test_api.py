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
    assert data["steps"] == {"trainer": 5, "orchestrator": 5}
    assert [r["step"] for r in data["trainer"]] == [1, 2, 3, 4, 5]
    assert [r["reward/a"] for r in data["orchestrator"]] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert data["orchestrator"][0]["staleness_mean"] == 0.25
    assert data["evals"] == [{"kind": "eval", "step": 2, "eval/a/reward": 0.5, "eval/a/pass@1": 0.5, "eval/a/ok": 4}]


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


def test_unknown_and_traversing_names_are_404(client):
    for url in ("/api/runs/missing/metrics", "/api/runs/not-a-run/metrics", "/api/runs/..%2F..%2Fetc/metrics"):
        assert client.get(url).status_code == 404, url


def test_pages_and_static_files_are_served(client):
    for url, text in [("/", "tandem runs"), ("/run/rl-run", 'data-page="run"'), ("/eval/evals", 'data-page="eval"')]:
        response = client.get(url)
        assert response.status_code == 200 and text in response.text
    assert "drawChart" in client.get("/static/app.js").text
    assert client.get("/static/style.css").status_code == 200
