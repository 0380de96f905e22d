"""The orchestrator loop against an in-process fake inference pool and a fake trainer."""

from __future__ import annotations

import asyncio
import json

import pytest

from support.orchestrator import FakeAdmin, make_config, run_orchestrator
from tandem.orchestrator.main import NoLearningSignal
from tandem.orchestrator.pool import Completion
from tandem.transport.batches import read_batch
from tandem.transport.policies import policy_dir


class FakePool:
    """Answers reverse_text prompts: group g gets `g % 3` wrong answers... all wrong when g % 3 == 0."""

    def __init__(self, tokenizer, fail_every: int = 0):
        self.tokenizer, self.version, self.idle_s, self.loaded = tokenizer, 0, 0.0, False
        self.groups, self.fail_every = 0, fail_every
        self.requests = [0]  # requests per server, as InferencePool counts them
        self.clients = [FakeAdmin()]

    async def wait_healthy(self):
        pass

    async def generate(self, prompt_ids, sampling, n):
        from tandem.client import RequestError

        group, self.groups = self.groups, self.groups + 1
        await asyncio.sleep(0.001)
        if self.fail_every and group % self.fail_every == 1:
            raise RequestError("5xx", "server said no", status=500)
        text = self.tokenizer.decode(prompt_ids).split("\n\n")[-1].split("<|im_end|>")[0]
        right = self.tokenizer(text[::-1] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        wrong = self.tokenizer("no idea<|im_end|>", add_special_tokens=False)["input_ids"]
        completions = []
        for i in range(n):
            ids = right if (group % 3 and i < group % 3) else wrong
            completions.append(Completion(list(ids), [-0.5] * len(ids), [self.version] * len(ids), "stop", None))
        return completions

    async def close(self):
        pass


def test_every_batch_is_full_and_filtered_groups_are_replaced(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, tiny_model_dir("qwen3"), keep_batches=True)
    pool = FakePool(None, fail_every=5)
    metrics = run_orchestrator(config, pool)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for step in range(1, 5):
        micros, header = read_batch(config.run_dir / "batches", step, 0, 1)
        assert header["num_samples"] == 8
        advantages = micros[0]["advantages"][micros[0]["target_ids"] != -100]
        assert advantages.abs().sum() > 0  # zero-advantage groups were filtered out
        weights = sum(float(m["loss_weights"].sum()) for m in micros)
        assert weights == pytest.approx(1.0)
    dropped = {k: sum(m.get(k, 0) for m in metrics) for k in ("dropped/zero_advantage", "dropped/error")}
    assert dropped["dropped/zero_advantage"] > 0 and dropped["dropped/error"] > 0
    assert 0 < metrics[0]["reward"] < 1
    assert pool.loaded and pool.clients[0].loads
    assert (policy_dir(config.run_dir / "policies", 4) / "COMPLETE").exists()


def test_async_level_bounds_how_far_inference_runs_ahead(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, tiny_model_dir("qwen3"), async_level=0, max_steps=3)
    metrics = run_orchestrator(config, FakePool(None))
    # async_level 0: batch N is sampled only with policy N-1
    for m in metrics:
        assert m["staleness"] == {"1": 8}, m


def test_stale_groups_are_dropped(tiny_model_dir, tmp_path):
    # async_level 2 lets batch N start with policy N-3; max_off_policy_steps 1 keeps only policy N-1.
    config = make_config(tmp_path, tiny_model_dir("qwen3"), async_level=2, max_off_policy_steps=1, max_steps=4)
    metrics = run_orchestrator(config, FakePool(None))
    assert sum(m.get("dropped/stale", 0) for m in metrics) > 0
    for m in metrics:
        assert m["staleness"] == {"1": 8}


def test_resume_restores_the_sampler(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, tiny_model_dir("qwen3"), max_steps=2)
    run_orchestrator(config, FakePool(None))
    points = json.loads((config.run_dir / "orchestrator_state.json").read_text())["resume_points"]
    assert set(points) == {"1", "2"}
    assert points["2"]["sampler"]["draws"] > points["1"]["sampler"]["draws"]


def test_what_every_server_has_moved_past_is_pruned(tiny_model_dir, tmp_path):
    """Once every server serves policy N: older policy directories and the (trained) batches up to N go; policy N,
    anything newer and the batches still to train stay. A server is never told to load a pruned policy."""
    config = make_config(tmp_path, tiny_model_dir("qwen3"), async_level=0, max_steps=6)
    pool = FakePool(None)
    run_orchestrator(config, pool)
    served = pool.version
    assert served >= 5  # async 0: batch 6 waited for policy 5
    assert [version for _, version in pool.clients[0].loads] == sorted({v for _, v in pool.clients[0].loads})
    policies = sorted(int(p.name.split("-")[1]) for p in (config.run_dir / "policies").iterdir())
    assert policies == list(range(served, 7))  # the final policy 6 always stays
    batches = sorted(int(p.name.split("-")[1].split(".")[0]) for p in (config.run_dir / "batches").iterdir())
    assert batches == list(range(served + 1, 7))


def test_pruning_keeps_batches_when_asked(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, tiny_model_dir("qwen3"), async_level=0, max_steps=3, keep_batches=True)
    run_orchestrator(config, FakePool(None))
    assert len(list((config.run_dir / "batches").glob("step-*.safetensors"))) == 3


class CollapsingPool(FakePool):
    """FakePool until group `collapse_at`, then one answer for every sample: a policy collapsed to one reply."""

    collapse_at = 6

    async def generate(self, prompt_ids, sampling, n):
        completions = await super().generate(prompt_ids, sampling, n)
        return completions if self.groups <= self.collapse_at else [completions[-1]] * n


def test_a_collapsed_policy_stops_the_run_instead_of_sampling_forever(tiny_model_dir, tmp_path):
    """Every group filtered for equal rewards, batch after batch: a clear error once NO_SIGNAL_BATCHES batches'
    worth of groups in a row had no signal (here 20 x 2), not a wait for batch_timeout_s."""
    config = make_config(tmp_path, tiny_model_dir("qwen3"), keep_batches=True, max_steps=8)
    pool = CollapsingPool(None)
    with pytest.raises(NoLearningSignal, match=r"last 40 groups .*filter_zero_advantage = false"):
        run_orchestrator(config, pool)
    assert (config.run_dir / "batches" / "step-000001.safetensors").exists()  # what had signal was trained
    assert pool.groups < 100  # stopped at the streak, not after drawing on


class LengthRecordingPool(FakePool):
    """FakePool that records the longest prompt it was asked to complete, and the max_tokens it was given."""

    longest_prompt = 0

    async def generate(self, prompt_ids, sampling, n):
        self.longest_prompt = max(self.longest_prompt, len(prompt_ids) + sampling.max_tokens)
        return await super().generate(prompt_ids, sampling, n)


LONG = {"min_words": 60, "max_words": 60}  # a reverse_text prompt of ~340 tokens with the tiny tokenizer


@pytest.mark.parametrize("env_id", ["reverse_text", "tandem.testing.toy_envs:LetterETurns"])
def test_prompts_too_long_for_seq_len_are_skipped_before_sampling(tiny_model_dir, tmp_path, env_id, caplog):
    """A prompt that leaves no room for a reply within seq_len is counted and skipped, never sent to a server nor
    packed (it used to crash pack_batch: the calculator env's 455-token prompt at seq_len 256), single- and
    multi-turn alike, and a reply is never asked to run past seq_len."""
    sources = [{"id": env_id, "args": {"max_words": 2}}, {"id": env_id, "args": LONG}]
    config = make_config(
        tmp_path, tiny_model_dir("qwen3"), source=sources, max_steps=2, filter_zero_advantage=False, keep_batches=True
    )
    pool = LengthRecordingPool(None)
    metrics = run_orchestrator(config, pool)
    assert [m["step"] for m in metrics] == [1, 2]
    assert sum(m.get("dropped/prompt_too_long", 0) for m in metrics) > 0
    assert 0 < pool.longest_prompt <= config.seq_len
    warnings = [r.getMessage() for r in caplog.records if "dropped/prompt_too_long" in r.getMessage()]
    assert len(warnings) == 1 and "does not fit seq_len 256" in warnings[0]  # once per source, not per prompt


def test_a_run_whose_prompts_are_all_too_long_stops_with_a_clear_error(tiny_model_dir, tmp_path):
    from tandem.orchestrator.rollouts import PromptsTooLong

    config = make_config(tmp_path, tiny_model_dir("qwen3"), source=[{"id": "reverse_text", "args": LONG}])
    pool = LengthRecordingPool(None)
    with pytest.raises(PromptsTooLong, match=r"did not fit seq_len 256 .* raise seq_len"):
        run_orchestrator(config, pool)
    assert pool.longest_prompt == 0  # nothing was sampled


def test_a_first_batch_without_signal_logs_the_filtered_samples_and_says_why(tiny_model_dir, tmp_path):
    """Every group of the first batch scores the same: the error speaks of the task and reward (not of a collapsed
    policy), and rollouts.jsonl, which only trained rollouts reached before, shows samples of what was filtered."""
    config = make_config(tmp_path, tiny_model_dir("qwen3"), log_samples=3)
    pool = CollapsingPool(None)
    pool.collapse_at = 0  # from the first group on
    with pytest.raises(NoLearningSignal, match=r"batch 1: .*no group has had a learning signal yet.*too hard") as error:
        run_orchestrator(config, pool)
    assert '"filtered": true' in str(error.value) and "rollouts.jsonl" in str(error.value)
    samples = [json.loads(line) for line in (config.run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == 3  # log_samples a step
    assert all(s["filtered"] and s["step"] == 1 and s["advantage"] == 0.0 for s in samples)
    assert all(s["prompt"] and isinstance(s["completion"], str) for s in samples)


def test_trained_rollouts_are_marked_unfiltered(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, tiny_model_dir("qwen3"), max_steps=2, log_samples=2)
    run_orchestrator(config, FakePool(None))
    samples = [json.loads(line) for line in (config.run_dir / "rollouts.jsonl").read_text().splitlines()]
    trained = [s for s in samples if not s["filtered"]]
    assert [s["step"] for s in trained] == [1, 1, 2, 2]
    assert all(s["filtered"] in (True, False) for s in samples)
