"""Reading run directories: followed metrics with bounded memory, derived idle times, discovery, path checks
and status."""

from __future__ import annotations

import itertools
import json
import os
import time

import pytest

import tandem.jsonl
from support.dashboard_records import heartbeat
from support.jsonl import write_jsonl
from tandem.dashboard.listing import list_runs
from tandem.dashboard.runs import STORED_POINTS, MetricsLog, Outputs, Strided, downsample
from tandem.run import records_clean_stop


def steps(log: MetricsLog) -> list[int]:
    return [r["step"] for r in log.update().steps.items()]


def test_a_half_written_last_line_waits_until_its_writer_finishes_it(outputs):
    path = outputs / "rl-run" / "metrics.jsonl"
    log = MetricsLog(path)
    assert steps(log) == [1, 2, 3, 4, 5]
    with path.open("a") as handle:
        handle.write('ss": 0.1}\n{"step": 7}\n')
    assert steps(log) == [1, 2, 3, 4, 5, 6, 7]


def test_a_rewritten_file_is_read_from_the_start_and_its_derived_values_restart(tmp_path):
    """A resumed trainer cuts metrics.jsonl back to its resume step, or a writer replaces the file."""
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"step": s, "idle_s": 1.0} for s in range(1, 11)])
    log = MetricsLog(path)
    assert steps(log) == list(range(1, 11)) and log.max_step == 10
    write_jsonl(path, [{"step": 1, "idle_s": 1.0}])
    assert steps(log) == [1] and log.max_step == 1
    assert log.steps.last["idle_total_s"] == 1.0
    replacement = tmp_path / "new.jsonl"
    write_jsonl(replacement, [{"step": 5}] * 20)
    os.replace(replacement, path)
    assert steps(log) == [5] * 20


def test_a_long_growing_run_is_parsed_incrementally(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"step": s, "loss": 1.0 / s} for s in range(1, 20_001)])
    log = MetricsLog(path).update()
    assert log.steps.count == 20_000
    with path.open("a") as handle:
        handle.write(json.dumps({"step": 20_001}) + "\n")
    parsed = []
    parse = tandem.jsonl.parse_line
    monkeypatch.setattr(tandem.jsonl, "parse_line", lambda line: parsed.append(line) or parse(line))
    assert log.update().steps.last == {"step": 20_001}
    assert parsed == [b'{"step": 20001}']  # only the appended line


def test_memory_is_bounded_however_long_the_run(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"step": s} for s in range(1, 100_001)])
    log = MetricsLog(path).update()
    kept = [r["step"] for r in log.steps.items()]
    assert log.steps.count == 100_000 and log.max_step == 100_000
    assert STORED_POINTS // 2 <= len(kept) <= STORED_POINTS + 1
    assert kept[0] == 1 and kept[-1] == 100_000
    gaps = {b - a for a, b in itertools.pairwise(kept[:-1])}
    assert gaps == {log.steps.stride}  # evenly strided, the latest record added on


@pytest.mark.parametrize("count", [1, 2, 7, 8, 9, 33, 1000])
def test_strided_keeps_every_stride_th_item_and_the_last(count):
    sample = Strided(capacity=8)
    for item in range(count):
        sample.add(item)
    items = sample.items()
    assert items[0] == 0 and items[-1] == count - 1 and len(items) <= 9
    assert all(item % sample.stride == 0 for item in items[:-1])
    assert items[:-1] == list(range(0, count - 1, sample.stride))[: len(items) - 1]


def test_downsample_keeps_first_and_last_and_bounds_the_count():
    records = list(range(10_000))
    points = downsample(records, 400)
    assert len(points) == 400
    assert points[0] == 0 and points[-1] == 9_999
    assert points == sorted(points)
    assert downsample(records[:5], 400) == records[:5]


def test_idle_times_are_derived_both_per_step_and_cumulative(tmp_path):
    """The trainer logs idle_s per step, the orchestrator inference_idle_s cumulatively (restarting at 0)."""
    trainer, orchestrator = tmp_path / "t.jsonl", tmp_path / "o.jsonl"
    write_jsonl(trainer, [{"step": s, "idle_s": float(s)} for s in (1, 2, 3)])
    write_jsonl(orchestrator, [{"step": s, "inference_idle_s": v} for s, v in enumerate([1.0, 3.0, 6.0, 2.0], 1)])
    assert [r["idle_total_s"] for r in MetricsLog(trainer).update().steps.items()] == [1.0, 3.0, 6.0]
    derived = [r["inference_idle_step_s"] for r in MetricsLog(orchestrator).update().steps.items()]
    assert derived == [1.0, 2.0, 3.0, 2.0]


def test_bad_values_are_ignored_where_numbers_are_needed(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": "ten", "idle_s": "slow", "staleness": {"x": 1}}\n[1, 2]\n"text"\nnot json\n'
        '{"step": NaN, "idle_s": Infinity, "staleness": {"1": "many"}}\n{"step": 3, "idle_s": 2.0}\n'
    )
    log = MetricsLog(path).update()
    assert log.max_step == 3 and log.steps.count == 3
    assert log.steps.last["idle_total_s"] == 2.0
    assert log.notes() == ["m.jsonl: 3 corrupt lines skipped"]


def test_runs_are_discovered_with_kind_status_steps_and_reward(outputs):
    rows = {row["name"]: row for row in list_runs(Outputs(outputs))}
    assert set(rows) == {"rl-run", "sft-old", "evals"}
    assert (rows["rl-run"]["kind"], rows["rl-run"]["status"], rows["rl-run"]["steps"]) == ("rl", "finished", 5)
    assert rows["rl-run"]["last_reward"] == 0.5
    assert (rows["sft-old"]["kind"], rows["sft-old"]["status"]) == ("sft", "failed")
    assert (rows["evals"]["kind"], rows["evals"]["status"], rows["evals"]["steps"]) == ("eval", "running", 6)
    assert all(row["problems"] == [] for row in rows.values())


def test_only_direct_children_are_runs(outputs):
    runs = Outputs(outputs)
    assert runs.run("rl-run").path == (outputs / "rl-run").resolve()
    for name in ("..", ".", "rl-run/../sft-old", "../" + outputs.name, "", "missing", "not-a-run", "a\0b"):
        assert runs.run(name) is None, name


def test_symlinks_out_of_the_outputs_directory_are_not_followed(outputs, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "rl.toml").write_text("")
    write_jsonl(outside / "metrics.jsonl", [{"step": 1, "secret": 42}])
    (outputs / "escape").symlink_to(outside, target_is_directory=True)
    (outputs / "rl-run" / "orchestrator_metrics.jsonl").unlink()
    (outputs / "rl-run" / "orchestrator_metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    (outputs / "alias").symlink_to(outputs / "sft-old", target_is_directory=True)  # inside: still a run
    runs = Outputs(outputs)
    assert runs.run("escape") is None
    assert [run.name for run in runs.runs()] == ["alias", "evals", "rl-run", "sft-old"]
    assert runs.metrics(runs.run("rl-run"), "orchestrator_metrics.jsonl") is None
    assert runs.metrics(runs.run("rl-run"), "metrics.jsonl").steps.count == 5


def test_a_live_inference_server_is_running_not_failed(tmp_path):
    server = tmp_path / "server"
    server.mkdir()
    (server / "inference.toml").write_text("")
    write_jsonl(server / "inference_metrics.jsonl", [heartbeat(0)])
    (row,) = list_runs(Outputs(tmp_path))
    assert (row["kind"], row["status"]) == ("inference", "running")
    old = time.time() - 600
    os.utime(server / "inference_metrics.jsonl", (old, old))
    os.utime(server / "inference.toml", (old, old))
    assert list_runs(Outputs(tmp_path))[0]["status"] == "failed"  # its heartbeat stopped long ago


def test_a_cleanly_stopped_server_is_stopped_and_a_dead_one_failed(tmp_path):
    """`records_clean_stop` marks a server that ended on SIGTERM or Ctrl-C; one that died leaves no mark."""
    old = time.time() - 600
    for name, ending in (("stopped", KeyboardInterrupt), ("died", RuntimeError)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "inference.toml").write_text("")
        with pytest.raises(ending), records_clean_stop(tmp_path / name, "inference"):
            write_jsonl(tmp_path / name / "inference_metrics.jsonl", [heartbeat(0)])
            raise ending
    rl = tmp_path / "rl-crashed"  # tandem rl's server stops cleanly when the trainer dies: the run still failed
    rl.mkdir()
    (rl / "rl.toml").write_text("max_steps = 5\n")
    write_jsonl(rl / "metrics.jsonl", [{"step": 1, "loss": 1.0}])
    with records_clean_stop(rl, "inference"):
        pass
    for path in tmp_path.rglob("*"):
        os.utime(path, (old, old))
    statuses = {row["name"]: row["status"] for row in list_runs(Outputs(tmp_path))}
    assert statuses == {"stopped": "stopped", "died": "failed", "rl-crashed": "failed"}
    with records_clean_stop(tmp_path / "stopped", "inference"):  # serving again in the same directory
        assert {row["name"]: row["status"] for row in list_runs(Outputs(tmp_path))}["stopped"] == "failed"


def test_a_run_with_unreadable_or_corrupt_files_is_listed_with_what_can_be_read(outputs, monkeypatch):
    (outputs / "sft-old" / "sft.toml").write_bytes(b"\xff\xfe not utf-8 \x00")
    (outputs / "nested").mkdir()
    (outputs / "nested" / "rl.toml").write_text("max_steps = " + "[" * 100_000)
    (outputs / "huge").mkdir()
    (outputs / "huge" / "rl.toml").write_text("max_steps = 1\n" + "# padding\n" * 200_000)
    (outputs / "evals" / "traces.jsonl").open("a").write('{"source": "a", "reward": "high"}\n{"broken\n')
    runs = Outputs(outputs)
    original = tandem.jsonl.JsonlFollower.new_records

    def unreadable(self):
        if self.path.name == "orchestrator_metrics.jsonl":
            raise PermissionError(13, "Permission denied")
        return original(self)

    monkeypatch.setattr(tandem.jsonl.JsonlFollower, "new_records", unreadable)
    rows = {row["name"]: row for row in list_runs(runs)}
    assert set(rows) == {"rl-run", "sft-old", "evals", "nested", "huge"}
    assert rows["nested"]["status"] == rows["huge"]["status"] == "failed"
    assert rows["rl-run"]["steps"] == 5 and rows["rl-run"]["last_reward"] is None
    assert rows["rl-run"]["problems"] == ["orchestrator_metrics.jsonl: Permission denied"]
    assert rows["sft-old"]["status"] == "failed"
    assert rows["evals"]["steps"] == 6
    assert rows["evals"]["problems"] == [
        "traces.jsonl: 1 corrupt lines skipped", "traces.jsonl: 1 incomplete trace records skipped"
    ]  # fmt: skip
