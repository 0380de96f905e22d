"""Reading run directories: tolerant JSONL, downsampling, discovery and status."""

from __future__ import annotations

from tandem.dashboard.runs import downsample, list_runs, read_jsonl, run_dir


def test_a_half_written_last_line_is_skipped(outputs):
    records = read_jsonl(outputs / "rl-run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]


def test_a_half_written_line_is_read_once_its_writer_finishes_it(outputs):
    path = outputs / "rl-run" / "metrics.jsonl"
    assert len(read_jsonl(path)) == 5
    with path.open("a") as handle:
        handle.write('ss": 0.1}\n{"step": 7}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6, 7]


def test_downsample_keeps_first_and_last_and_bounds_the_count():
    records = list(range(10_000))
    points = downsample(records, 400)
    assert len(points) == 400
    assert points[0] == 0 and points[-1] == 9_999
    assert points == sorted(points)
    assert downsample(records[:5], 400) == records[:5]


def test_runs_are_discovered_with_kind_status_steps_and_reward(outputs):
    runs = {run["name"]: run for run in list_runs(outputs)}
    assert set(runs) == {"rl-run", "sft-old", "evals"}
    assert (runs["rl-run"]["kind"], runs["rl-run"]["status"], runs["rl-run"]["steps"]) == ("rl", "finished", 5)
    assert runs["rl-run"]["last_reward"] == 0.5
    assert (runs["sft-old"]["kind"], runs["sft-old"]["status"]) == ("sft", "failed")
    assert (runs["evals"]["kind"], runs["evals"]["status"], runs["evals"]["steps"]) == ("eval", "running", 6)


def test_only_direct_children_are_runs(outputs):
    assert run_dir(outputs, "rl-run") == outputs / "rl-run"
    for name in ("..", ".", "rl-run/../sft-old", "../" + outputs.name, "", "missing"):
        assert run_dir(outputs, name) is None
