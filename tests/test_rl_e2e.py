"""`tandem rl` end to end on CPU with a tiny model: three processes, policies flowing back, clean stops."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from support.jsonl import read_jsonl, read_metrics
from support.runs import rl_command, run_to_end, tandem_rl, write_rl_sources
from tandem.jsonl import read_records
from tandem.testing.progress import spawn, tree_state, wait_for
from tandem.trainer.ckpt import list_checkpoints

pytestmark = pytest.mark.slow


def test_rl_runs_trains_and_serves_each_new_policy(tiny_model_dir, tmp_path):
    result = tandem_rl(
        tiny_model_dir("qwen3"), tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", "3",
        "--orchestrator.async-level", "0", "--orchestrator.no-filter-zero-advantage",
        "--trainer.weights.transport", "file", "--orchestrator.keep-batches", "--orchestrator.eval.at-start",
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    trainer, stream = read_metrics(run_dir), read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    rollouts = [r for r in stream if r.get("kind") != "eval"]
    evals = [r for r in stream if r.get("kind") == "eval"]
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2, 3]
    # async_level 0: batch N is sampled by policy N-1, which the trainer holds at step N, so the
    # measured mismatch is the numerical one between the trainer and the inference engine.
    assert all(r["mismatch_kl"] is not None and abs(r["mismatch_kl"]) < 1e-3 for r in trainer), trainer
    assert [r["policy_version"] for r in rollouts] == [0, 1, 2]
    assert all(r["staleness"] == {"1": 16} for r in rollouts)
    # every policy was a directory; once every server served policy N, the older ones were pruned
    assert (run_dir / "policies" / "step-000003" / "COMPLETE").exists()
    assert not (run_dir / "policies" / "step-000001").exists()
    assert len(list((run_dir / "batches").glob("step-*.safetensors"))) == 3  # keep_batches
    assert "step 3/3" in result.stderr
    # online evals of the starting policy and every 2 steps, through the eval stack, in the same metrics stream
    assert [(e["step"], e["policy_version"]) for e in evals] == [(0, 0), (2, 1)]
    for evaluation in evals:
        assert sum(evaluation[f"eval/arithmetic/{o}"] for o in ("ok", "truncated", "timeout", "error")) == 3
        assert evaluation["eval/arithmetic/error"] == 0 and evaluation["eval/arithmetic/reward"] is not None
    assert len(read_jsonl(run_dir / "evals" / "step-000002" / "traces.jsonl")) == 3
    assert len(read_jsonl(run_dir / "evals" / "step-000000" / "traces.jsonl")) == 3


def test_a_failing_child_stops_the_run_with_its_error(tiny_model_dir, tmp_path):
    """Arguments the env's constructor refuses pass the launcher's check (which builds nothing) and fail the
    orchestrator: the run stops, and the launcher's tail of its log ends at the error it died of."""
    sources = tmp_path / "bad.toml"
    sources.write_text('[[orchestrator.source]]\nid = "reverse_text"\nargs = { min_words = 0 }\n')
    result = tandem_rl(tiny_model_dir("qwen3"), tmp_path, "@", str(sources), "--max-steps", "2", check=False)
    assert result.returncode == 1
    stderr = " ".join(result.stderr.split())  # the console wraps long log lines
    assert "orchestrator exited with code 2" in stderr
    assert "tandem orchestrator: error: source 'reverse_text': need 1 <= min_words <= max_words, got 0" in stderr


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("env_id", ["LetterE", "LetterETurns"])
def test_killed_rl_run_resumes_without_losing_or_repeating_steps(tiny_model_dir, tmp_path, env_id):
    """prime-rl's resume check, in the default async setting (async_level 1): a run killed between checkpoints,
    with batches sampled past the checkpoint, resumes with every step exactly once and keeps learning; single-turn,
    and multi-turn (two replies an episode, both trained)."""
    sources = tmp_path / "letter_e.toml"
    sources.write_text(
        f'[[orchestrator.source]]\nid = "tandem.testing.toy_envs:{env_id}"\nsampling = {{ max_tokens = 16 }}\n'
    )
    command = rl_command(
        tiny_model_dir("qwen3"), tmp_path, "@", str(sources), "--max-steps", "12", "--trainer.ckpt.interval", "3",
        "--trainer.optim.lr", "3e-2", "--orchestrator.log-samples", "2",
    )  # fmt: skip
    run_dir = tmp_path / "rl"

    def past_checkpoint_6() -> bool:
        return any(r["step"] == 7 for r in read_records(run_dir / "metrics.jsonl"))

    with spawn(command, watch=[run_dir]) as launcher:
        launcher.wait_until(past_checkpoint_6, "step 7")
        launcher.kill()
    # the children follow their parent (PR_SET_PDEATHSIG); dying, they may still write
    wait_for(lambda: not _processes_mentioning(str(run_dir)), lambda: tree_state([run_dir]))
    newest = max(list_checkpoints(run_dir / "checkpoints"))
    assert newest < max(r["step"] for r in read_records(run_dir / "metrics.jsonl")), "killed between checkpoints"
    assert max(r["step"] for r in read_records(run_dir / "orchestrator_metrics.jsonl")) > newest  # sampled ahead

    run_to_end([*command, "--resume"], watch=[run_dir])
    trainer = read_metrics(run_dir)
    rollouts = [r for r in read_jsonl(run_dir / "orchestrator_metrics.jsonl") if r.get("kind") != "eval"]
    assert [r["step"] for r in trainer] == list(range(1, 13))
    assert [r["step"] for r in rollouts] == list(range(1, 13))
    assert [r["step"] for r in read_jsonl(run_dir / "rollouts.jsonl")] == [s for s in range(1, 13) for _ in (0, 1)]
    # the final policy is the run's result; what every server moved past was pruned, batches included
    assert sorted(p.name for p in (run_dir / "policies").iterdir()) == ["step-000012"]
    # batch 12 waited for policy 10 (async_level 1): the trained batches up to 10 are gone
    assert {p.name for p in (run_dir / "batches").iterdir()} <= {f"step-{s:06d}.safetensors" for s in (11, 12)}
    # The reward keeps rising through the resume (an uninterrupted run: 0.09 over the first 3 steps, 0.37 over
    # the last 3; resumed, 0.10 -> 0.28 single-turn and 0.08 -> 0.25 over two turns), far above the batch-to-batch
    # noise (~0.02).
    assert env_id == "LetterE" or all(r["turns"] == 2.0 for r in rollouts)
    rewards = [r["reward"] for r in rollouts]
    print(f"{env_id}: reward over the first 3 steps {sum(rewards[:3]) / 3:.3f}, the last 3 {sum(rewards[-3:]) / 3:.3f}")
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_top_k_top_p_rollouts_replay_the_same_distribution_in_the_trainer(tiny_model_dir, tmp_path):
    sources = tmp_path / "truncated.toml"
    sources.write_text(
        '[[orchestrator.source]]\nid = "reverse_text"\nsampling = { top_k = 20, top_p = 0.8, max_tokens = 16 }\n'
    )
    flags = ["--max-steps", "2", "--orchestrator.async-level", "0", "--orchestrator.no-filter-zero-advantage"]
    flags += ["--orchestrator.keep-batches"]  # batch 1 is read back below
    tandem_rl(tiny_model_dir("qwen3"), tmp_path, "@", str(sources), *flags)
    from tandem.transport.batches import KEPT_COUNTS, read_batch

    micros, _ = read_batch(tmp_path / "rl" / "batches", 1, 0, 1)
    counts = micros[0][KEPT_COUNTS][micros[0]["target_ids"] != -100]  # the kept ids, stored as CSR
    assert ((counts >= 1) & (counts <= 20)).all()  # every token's top-k ids
    # p (trainer, renormalised over the kept ids) and q (engine) are the same distribution: KL ~ 0
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in read_metrics(tmp_path / "rl"))


def test_ctrl_c_stops_every_process(tiny_model_dir, tmp_path):
    """Also: the run's server refuses an admin call without the run's token, while the orchestrator's own (it has
    joined the trainer's weight hand-off, an admin route, before the first rollout) went through."""
    command = rl_command(tiny_model_dir("qwen3"), tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", "1000")
    run_dir = tmp_path / "rl"
    metrics = run_dir / "metrics.jsonl"
    with spawn(command, watch=[run_dir]) as launcher:
        launcher.wait_until(lambda: metrics.exists() and metrics.stat().st_size > 0, "the first trainer step")
        url = json.loads((run_dir / "server.json").read_text())["url"]
        assert httpx.post(f"{url}/pause").status_code == 401
        assert httpx.post(f"{url}/update_weights", json={"path": "x", "version": 666}).status_code == 401
        os.kill(launcher.pid, signal.SIGINT)  # the launcher alone: it stops its children itself
        result = launcher.wait()
    assert result.returncode == 130, result.stderr[-2000:]
    assert "interrupted" in result.stderr
    assert not _processes_mentioning(str(run_dir))  # every child was stopped before tandem rl returned
