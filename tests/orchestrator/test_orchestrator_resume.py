"""Orchestrator resume: every draw not settled by the batch resumed from is drawn again, no settled one is; the
resume points every kept trainer checkpoint needs survive; the rollout log is cut back with the metrics."""

from __future__ import annotations

import asyncio
import json

import pytest

from support.jsonl import read_jsonl
from support.orchestrator import FakeAdmin, make_config, run_orchestrator
from tandem.orchestrator.main import Orchestrator
from tandem.orchestrator.pool import Completion
from tandem.orchestrator.tasks import DrawLedger, TaskSampler, load_sources
from tandem.transport.batches import batch_path, read_batch
from tandem.transport.policies import mark_complete, policy_dir

GROUP = 4


class SeededPool:
    """A reverse_text server whose answers depend only on the request's seed, which it also writes into every
    logprob (-(seed + 1) / 1024), so a batch tells which draws it trained. Seeds divisible by 3 get four equal
    (wrong) answers: no signal, dropped."""

    def __init__(self, tokenizer=None):
        self.tokenizer, self.version, self.idle_s, self.requests = tokenizer, 0, 0.0, [0]
        self.loaded, self.clients = False, [FakeAdmin()]

    async def wait_healthy(self):
        pass

    async def generate(self, prompt_ids, sampling, n):
        seed = sampling.seed
        await asyncio.sleep(0.002 * (seed % 4))  # finish out of draw order
        text = self.tokenizer.decode(prompt_ids).split("\n\n")[-1].split("<|im_end|>")[0]
        right = self.tokenizer(text[::-1] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        wrong = self.tokenizer("no idea<|im_end|>", add_special_tokens=False)["input_ids"]
        completions = []
        for i in range(n):
            ids = right if (seed % 3 and i < seed % 3) else wrong
            logprobs = [-(seed + 1) / 1024] * len(ids)
            completions.append(Completion(list(ids), logprobs, [self.version] * len(ids), "stop", None))
        return completions

    async def close(self):
        pass


def publish(run_dir, *steps):
    for step in steps:
        path = policy_dir(run_dir / "policies", step)
        path.mkdir(parents=True, exist_ok=True)
        mark_complete(path)


def trained_seeds(run_dir, steps) -> list[int]:
    """The seeds (= draw indices, seed 0) of the groups trained in each batch, one entry per group."""
    seeds = []
    for step in steps:
        micros, _ = read_batch(run_dir / "batches", step, 0, 1)
        for micro in micros:
            for targets, logprobs in zip(micro["target_ids"], micro["inference_logprobs"], strict=True):
                on = (targets != -100).tolist()
                starts = [i for i, flag in enumerate(on) if flag and (i == 0 or not on[i - 1])]  # one per rollout
                seeds += [round(-float(logprobs[i]) * 1024) - 1 for i in starts]
    counts = {seed: seeds.count(seed) for seed in set(seeds)}
    assert all(count % GROUP == 0 for count in counts.values()), counts  # whole groups, never split
    return sorted(seed for seed, count in counts.items() for _ in range(count // GROUP))


def test_groups_in_flight_at_a_kill_are_drawn_again_on_resume(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen3")
    # Policies 1 and 2 exist from the start, so with async_level 1 inference samples batches 1-3 at once
    # (3 needs policy >= 1): when batch 2 is written, groups meant for batch 3 are in flight or waiting.
    publish(tmp_path / "run", 1, 2)
    first = make_config(tmp_path, model, async_level=1, max_steps=3, keep_batches=True)
    run_orchestrator(first, SeededPool(), with_trainer=False)
    # The trainer's checkpoint is step 2: resume there, as `tandem rl --resume` does (batch 3 is removed).
    batch_path(first.run_dir / "batches", 3).unlink()
    resumed = make_config(tmp_path, model, async_level=1, max_steps=4, resume_step=2, keep_batches=True)
    run_orchestrator(resumed, SeededPool(), with_trainer=False)
    seeds = trained_seeds(first.run_dir, range(1, 5))
    # Nothing lost, nothing twice: the trained draws are every draw with a signal up to the last one.
    assert seeds == [s for s in range(max(seeds) + 1) if s % 3], seeds
    assert len(seeds) == 4 * 8 // GROUP


def test_a_resumed_sampler_skips_only_what_settled():
    ledger, sampler = DrawLedger(), TaskSampler(load_sources([_source()]), seed=0)
    draws = [sampler.next() for _ in range(4)]
    for draw in draws:
        ledger.opened(draw)
    ledger.settle(draws[0].index)  # trained
    ledger.settle(draws[2].index)  # dropped, after the first open draw (1)
    point = ledger.resume_point(sampler)
    assert point == {"sampler": draws[1].state_before, "skip": [2]}
    again = TaskSampler(load_sources([_source()]), seed=0)
    again.resume(point)
    redrawn = [again.next() for _ in range(2)]
    assert [d.index for d in redrawn] == [1, 3]
    assert [d.task.id for d in redrawn] == [draws[1].task.id, draws[3].task.id]
    # A second kill before draw 2's index is passed again must still skip it.
    assert DrawLedger(open={1: draws[1].state_before}).resume_point(again)["skip"] == [2]


def _source():
    from tandem.config.orchestrator import TrainSourceConfig

    return TrainSourceConfig(id="reverse_text")


def test_resume_points_are_kept_for_every_kept_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    config = make_config(tmp_path, tiny_model_dir("qwen3"), max_steps=200)
    pool = SeededPool()
    orchestrator = Orchestrator(config, AutoTokenizer.from_pretrained(config.model.name), pool)
    checkpoints = config.run_dir / "checkpoints"
    for step in (2, 150):  # ckpt.keep = 2: the oldest kept is far behind the newest batch
        (checkpoints / f"step-{step:06d}").mkdir(parents=True)
        (checkpoints / f"step-{step:06d}" / "state.json").write_text("{}")
    points: dict = {}
    for step in range(1, 201):
        pool.version = step - 1
        orchestrator._save_state(step, points)
    saved = json.loads((config.run_dir / "orchestrator_state.json").read_text())["resume_points"]
    assert sorted(map(int, saved)) == list(range(2, 201))
    assert orchestrator._resume(2) == {"2": saved["2"]}
    # Without checkpoints, only what a checkpoint the trainer may be writing now (the newest policy) needs.
    for path in checkpoints.iterdir():
        (path / "state.json").unlink()
    orchestrator._save_state(201, points)
    assert sorted(map(int, points)) == [199, 200, 201]
    with pytest.raises(ValueError, match=r"no orchestrator state for step 2 .* has steps \[199, 200, 201\]"):
        Orchestrator(config, orchestrator.tokenizer, pool)._resume(2)


def test_rollouts_are_logged_as_text_and_cut_back_on_resume(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen3")
    publish(tmp_path / "run", 1, 2)
    first = make_config(tmp_path, model, max_steps=3, log_samples=3, keep_batches=True)
    run_orchestrator(first, SeededPool(), with_trainer=False)
    path = first.run_dir / "rollouts.jsonl"
    logged = read_jsonl(path)
    rows = [r for r in logged if not r["filtered"]]  # trained; the others' groups were filtered for equal rewards
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    keys = {"step", "source", "task_id", "prompt", "completion", "reward", "advantage", "outcome", "version", "metrics"}
    assert all(set(r) == {*keys, "filtered"} for r in logged)
    assert all(r["advantage"] == 0.0 for r in logged if r["filtered"])
    row = rows[0]
    # the newest policy, loaded first
    assert row["source"] == "reverse_text" and row["outcome"] == "ok" and row["version"] == 2
    assert "<|im_start|>" in row["prompt"]  # the prompt as the model saw it, chat template included
    assert all(r["completion"] == "no idea" or r["completion"][::-1] in r["prompt"] for r in rows)  # as scored
    assert isinstance(row["metrics"], dict) and "truncated" in row["metrics"]
    assert all(r["reward"] == pytest.approx(1.0 if r["completion"] != "no idea" else 0.0, abs=0.5) for r in rows)
    micros, _ = read_batch(first.run_dir / "batches", 1, 0, 1)
    trained = {float(a) for m in micros for a in m["advantages"][m["target_ids"] != -100].unique()}
    assert all(any(r["advantage"] == pytest.approx(a, abs=1e-6) for a in trained) for r in rows[:3])
    batch_path(first.run_dir / "batches", 3).unlink()
    resumed = make_config(tmp_path, model, max_steps=3, log_samples=3, resume_step=2)
    run_orchestrator(resumed, SeededPool(), with_trainer=False)
    after = read_jsonl(path)
    assert [r["step"] for r in after if not r["filtered"]] == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # step 3 once
    assert [r for r in after if r["step"] <= 2] == [r for r in logged if r["step"] <= 2]  # the kept steps as they were
    off = make_config(tmp_path / "off", model, max_steps=1, log_samples=0)
    publish(off.run_dir, 1)
    run_orchestrator(off, SeededPool(), with_trainer=False)
    assert not (off.run_dir / "rollouts.jsonl").exists()
