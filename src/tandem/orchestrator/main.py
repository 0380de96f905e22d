"""`tandem orchestrator`: keeps inference busy, scores rollouts, and writes one full batch per trainer step.

The async model (docs/rl.md): batch N trains at step N and produces policy N. Rollout groups for
batch N may start once inference serves a policy >= N - 1 - async_level, so with async_level 1
inference samples batch N+1 while the trainer trains step N. When batch N is assembled, a sample
whose oldest token came from a policy older than N - max_off_policy_steps is dropped. Groups that
error, time out, go stale, or (with filter_zero_advantage) carry no signal are replaced by
sampling more, so every batch has exactly batch_size rollouts.

Resuming after batch N (the trainer's checkpoint) draws again every group that had not settled when
batch N was written (`DrawLedger`), so a kill loses no draw and trains none twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.checkpoints import checkpoints_root, list_checkpoints
from tandem.config.orchestrator import OrchestratorConfig
from tandem.envs.sandbox import start_sandbox
from tandem.files import atomic_write_text
from tandem.jsonl import JsonlWriter, keep_steps_up_to
from tandem.orchestrator.advantages import group_advantages, loss_weights
from tandem.orchestrator.batching import TrainSample, pack_batch, replay_overflow
from tandem.orchestrator.evals import run_online_eval
from tandem.orchestrator.pool import InferencePool
from tandem.orchestrator.rollouts import Group, Rollouts
from tandem.orchestrator.tasks import Draw, DrawLedger, TaskSampler, check_sources, load_sources
from tandem.run import RunError, prepare_run_dir
from tandem.transport.batches import batch_path, write_batch
from tandem.transport.policies import prune_policies
from tandem.transport.weights.base import PolicyFollower
from tandem.transport.weights.follower import make_follower

logger = logging.getLogger(__name__)

ORCHESTRATOR_METRICS_FILE = "orchestrator_metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"
STATE_FILE = "orchestrator_state.json"
# per-step JSONL records, cut back to the step a run resumes from
PER_STEP_FILES = (ORCHESTRATOR_METRICS_FILE, ROLLOUTS_FILE)


NO_SIGNAL_BATCHES = 20
"""Stop when this many batches' worth of groups in a row scored the same within every group (filtered out): the
policy has collapsed (it samples one answer) or the reward never varies, and sampling more will not fill a batch."""


class NoLearningSignal(RunError):
    """Every recent group was filtered out for equal rewards; the message says what to check."""


@dataclass
class StepStats:
    dropped: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    filtered_logged: int = 0  # filtered groups of this step written to rollouts.jsonl


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tokenizer: Any, pool: InferencePool):
        self.config, self.tokenizer, self.pool = config, tokenizer, pool
        self.sampler = TaskSampler(load_sources(config.source), config.seed)
        self.ledger = DrawLedger()
        self.run_dir = config.run_dir
        self.per_batch = config.batch_size // config.group_size
        self.assigned: Counter[int] = Counter()  # groups started or kept for each batch
        self.buckets: dict[int, asyncio.Queue[Group | BaseException]] = {}
        self.filling = 1  # the batch being assembled
        self._batches_pruned = 0  # batch files up to this step are deleted
        self.stats = StepStats()
        self.equal_streak = 0  # groups filtered for equal rewards since the last group kept
        self.streak_rewards: Counter[float] = Counter()  # the reward each group of the streak gave every rollout
        self.kept_any = False  # whether this process has kept a group for a batch yet
        self.rollouts = Rollouts(
            tokenizer,
            pool,
            self.sampler.sources,
            seq_len=config.seq_len,
            group_size=config.group_size,
            seed=config.seed,
            max_long_streak=NO_SIGNAL_BATCHES * self.per_batch,
        )

    # -- producing groups -------------------------------------------------------------------------

    def _bucket(self, step: int) -> asyncio.Queue[Group | BaseException]:
        return self.buckets.setdefault(step, asyncio.Queue())

    def _next_target(self) -> int | None:
        """The earliest batch that still needs a group and that the loaded policy may sample for."""
        newest = min(self.config.max_steps, self.pool.version + 1 + self.config.async_level)
        return next((b for b in range(self.filling, newest + 1) if self.assigned[b] < self.per_batch), None)

    async def _producer(self) -> None:
        """Keep up to `max_concurrent` groups in flight, each meant for one batch within the async bound."""
        in_flight: dict[asyncio.Task, tuple[int, Draw]] = {}
        while True:
            while len(in_flight) < self.config.inference.max_concurrent and (target := self._next_target()):
                self.assigned[target] += 1
                draw = self.sampler.next()
                self.ledger.opened(draw)
                in_flight[asyncio.create_task(self.rollouts.roll(draw))] = target, draw
            if not in_flight:
                await asyncio.sleep(0.01)
                continue
            done, _ = await asyncio.wait(in_flight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                target, draw = in_flight.pop(task)
                try:
                    group = task.result()
                except BaseException as error:  # a bug, not a bad rollout: surface it
                    await self._bucket(self.filling).put(error)
                    return
                if isinstance(group, str):  # errored, timed out or too long: sample a replacement
                    self.stats.dropped[group] += 1
                    self.assigned[target] -= 1
                    self.ledger.settle(draw.index)
                else:
                    for outcome, count in group.failed.items():
                        self.stats.dropped[f"rollout_{outcome}"] += count
                    await self._bucket(target).put(group)

    # -- assembling batches -----------------------------------------------------------------------

    def _keep(self, group: Group, step: int) -> bool:
        if step - group.oldest_version > self.config.max_off_policy_steps:
            self.stats.dropped["stale"] += 1
            return False
        if self.config.filter_zero_advantage and max(group.rewards) == min(group.rewards):
            self.stats.dropped["zero_advantage"] += 1
            self.equal_streak += 1
            self.streak_rewards[group.rewards[0]] += 1
            self._log_filtered(step, group)
            if self.equal_streak >= NO_SIGNAL_BATCHES * self.per_batch:
                raise self._no_signal(step)
            return False
        self.equal_streak = 0
        self.streak_rewards.clear()
        self.kept_any = True
        return True

    def _no_signal(self, step: int) -> NoLearningSignal:
        """What a streak of groups without signal means: at the run's first batch, a task or reward that does
        not fit the starting model; later, a policy that collapsed."""
        rewards = ", ".join(f"{reward:g} ({n})" for reward, n in self.streak_rewards.most_common(4))
        seen = (
            f"batch {step}: the last {self.equal_streak} groups each scored the same for every rollout (reward "
            f"(groups): {rewards}) and were filtered out"
        )
        samples = (
            f'see the filtered samples in {self.run_dir / ROLLOUTS_FILE} ("filtered": true)'
            if self._rollouts_out is not None
            else "set orchestrator.log_samples to see samples"
        )
        if step == 1 and not self.kept_any:
            return NoLearningSignal(
                f"{seen}: no group has had a learning signal yet, so the tasks are too hard for the starting model "
                "(every reward 0), too easy (every reward full), or the reward function scores every answer alike; "
                f"{samples}, try the environment with `tandem eval`, or set orchestrator.filter_zero_advantage = "
                "false to train on them anyway"
            )
        return NoLearningSignal(
            f"{seen}: the policy has collapsed to one answer or the reward never varies on these tasks; {samples}, "
            "lower the learning rate, or set orchestrator.filter_zero_advantage = false to train on them anyway"
        )

    async def _collect(self, step: int) -> list[Group]:
        groups: list[Group] = []
        bucket = self._bucket(step)
        deadline = time.monotonic() + self.config.batch_timeout_s
        while len(groups) < self.per_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"batch {step} not filled in {self.config.batch_timeout_s:.0f}s; dropped: {dict(self.stats.dropped)}"
                )
            try:
                item = await asyncio.wait_for(bucket.get(), remaining)
            except TimeoutError:
                continue
            if isinstance(item, BaseException):
                raise item
            if self._keep(item, step):
                groups.append(item)
            else:
                self.assigned[step] -= 1  # make room for a replacement
                self.ledger.settle(item.draw.index)
        del self.buckets[step]
        return groups

    def _samples(self, groups: list[Group]) -> tuple[list[TrainSample], list[dict]]:
        """The batch's training samples, and a record of each (its group, position in it, reward, advantage)."""
        advantage = self.config.advantage
        members, records = [], []
        for index, group in enumerate(groups):
            lengths = [len(c.token_ids) for c in group.completions]
            advantages = group_advantages(group.rewards, lengths, advantage.baseline, advantage.normalize_std)
            for member, (completion, reward, adv) in enumerate(
                zip(group.completions, group.rewards, advantages, strict=True)
            ):
                members.append((index, group, member, completion, adv))
                records.append(
                    {
                        "group": group,
                        "member": member,
                        "source": group.source.name,
                        "reward": reward,
                        "advantage": adv,
                        "tokens": len(completion.token_ids),
                    }
                )
        targets = [len(c.token_ids) if c.trained is None else sum(c.trained) for *_, c, _ in members]
        weights = loss_weights(targets, [index for index, *_ in members], advantage.aggregation)
        samples = [
            TrainSample(
                prompt_ids=group.prompt_of(member),
                completion_ids=completion.token_ids,
                logprobs=completion.logprobs,
                advantage=adv,
                weight=weight,
                temperature=group.source.config.sampling.temperature,
                versions=completion.versions,
                kept_ids=completion.kept_ids,
                trained=completion.trained,
                images=group.images,
                image_spans=group.image_spans,
            )
            for (_, group, member, completion, adv), weight in zip(members, weights, strict=True)
        ]
        return samples, records

    def _metrics(
        self, step: int, groups: list[Group], records: list[dict], samples: list[TrainSample]
    ) -> dict[str, Any]:
        rewards = [r["reward"] for r in records]
        by_source: dict[str, list[float]] = {}
        for record in records:
            by_source.setdefault(record["source"], []).append(record["reward"])
        staleness = Counter(step - min(c.versions, default=step) for g in groups for c in g.completions)
        elapsed = time.monotonic() - self.stats.started
        tokens = sum(r["tokens"] for r in records)
        return {
            "step": step,
            "reward": sum(rewards) / len(rewards),
            **{f"reward/{name}": sum(v) / len(v) for name, v in by_source.items()},
            "advantage_abs_mean": sum(abs(r["advantage"]) for r in records) / len(records),
            "truncated": sum(m["truncated"] for g in groups for m in g.metrics) / len(records),
            "turns": sum(m.get("turns", 1.0) for g in groups for m in g.metrics) / len(records),
            **{
                name: sum(m.get(name, 0.0) for g in groups for m in g.metrics) / len(records)
                for name in ("tool_calls", "tool_errors")
                if any(name in m for g in groups for m in g.metrics)
            },
            **{f"dropped/{reason}": count for reason, count in self.stats.dropped.items()},
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "completion_tokens": tokens,
            "replay_overflow_tokens": replay_overflow(samples),
            "rollout_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "batch_time_s": elapsed,
            "inference_idle_s": self.pool.idle_s,
            "inference_requests": list(self.pool.requests),
            "policy_version": self.pool.version,
            "time": time.time(),
        }

    # -- policies ---------------------------------------------------------------------------------

    async def _follow_policies(self, follower: PolicyFollower) -> None:
        """Bring every server to each policy the trainer publishes, and prune what that makes obsolete."""
        pruned = self.pool.version
        while True:
            await follower.poll()
            if self.pool.version > pruned:
                pruned = self.pool.version
                self._prune(pruned)
            await asyncio.sleep(0.05)

    def _prune(self, served: int) -> None:
        """Every server serves policy `served`: no server loads an older policy directory again, and the
        trainer has trained every batch up to `served` (a resume starts after a checkpoint <= `served`, from
        batches the orchestrator writes again; its policy the trainer re-exports if it is gone)."""
        prune_policies(self.run_dir / "policies", served)
        if not self.config.keep_batches:
            for step in range(self._batches_pruned + 1, served + 1):
                batch_path(self.run_dir / "batches", step).unlink(missing_ok=True)
            self._batches_pruned = max(self._batches_pruned, served)

    async def _wait_for_policy(self, version: int) -> None:
        deadline = time.monotonic() + self.config.policy_timeout_s
        while self.pool.version < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no policy >= {version} from the trainer in {self.config.policy_timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    # -- online evals -----------------------------------------------------------------------------

    def _rollout_record(
        self, step: int, group: Group, member: int, advantage: float, filtered: bool = False
    ) -> dict[str, Any]:
        """One rollout as text, for reading what RL generated (`rollouts.jsonl`); `filtered`: its group was
        dropped for equal rewards, never trained."""
        completion = group.completions[member]
        return {
            "step": step,
            "source": group.source.name,
            "task_id": group.draw.task.id,
            "prompt": self.tokenizer.decode(group.prompt_of(member)),
            "completion": (group.conversations or group.texts)[member],
            "reward": group.rewards[member],
            "advantage": advantage,
            "outcome": "truncated" if completion.finish_reason == "length" else "ok",
            "version": min(completion.versions, default=None),
            "metrics": group.metrics[member],
            "filtered": filtered,
        }

    def _log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        """`log_samples` of the batch's rollouts, spread evenly over its groups."""
        count = min(self.config.log_samples, len(records))
        for k in range(count):
            record = records[k * len(records) // count]
            self._rollouts_out.write(self._rollout_record(step, record["group"], record["member"], record["advantage"]))

    def _log_filtered(self, step: int, group: Group) -> None:
        """A rollout of each of the first `log_samples` groups filtered out of batch `step`, written as it is
        filtered: a run that stops for lack of signal has shown what it sampled."""
        if self._rollouts_out is None or self.stats.filtered_logged >= self.config.log_samples:
            return
        self.stats.filtered_logged += 1
        self._rollouts_out.write(self._rollout_record(step, group, 0, 0.0, filtered=True))

    async def _online_eval(self, step: int) -> None:
        """Evaluate the policy being served, beside the training rollouts; one `kind = "eval"` record."""
        version, started = self.pool.version, time.monotonic()
        out_dir = self.run_dir / "evals" / f"step-{step:06d}"
        base_url = self.config.inference.base_urls[0]
        metrics = await run_online_eval(self.config.eval, base_url, self.pool.admin_token, out_dir)
        self._metrics_out.write(
            {
                "step": step,
                "kind": "eval",
                "policy_version": version,
                **metrics,
                "eval_time_s": time.monotonic() - started,
                "time": time.time(),
            }
        )
        logger.info(
            "eval at step %d (policy %d): %s",
            step,
            version,
            {k: v for k, v in metrics.items() if k.endswith("/reward")},
        )

    # -- the loop ---------------------------------------------------------------------------------

    def _state_path(self) -> Path:
        return self.run_dir / STATE_FILE

    def _oldest_needed_step(self) -> int:
        """The oldest step a later resume may start from: the oldest kept trainer checkpoint, or (before one
        exists) the newest policy, whose checkpoint the trainer may be writing now."""
        return min(min(list_checkpoints(checkpoints_root(self.run_dir)), default=math.inf), self.pool.version)

    def _save_state(self, step: int, points: dict[str, Any]) -> None:
        """Record where a run resumed after batch `step` starts drawing; forget only what no checkpoint needs."""
        points[str(step)] = self.ledger.resume_point(self.sampler)
        oldest = self._oldest_needed_step()
        for key in [k for k in points if int(k) < oldest]:
            del points[key]
        atomic_write_text(self._state_path(), json.dumps({"resume_points": points}))

    def _resume(self, step: int) -> dict[str, Any]:
        """Restore the sampler as it was when batch `step` (the trainer's checkpoint) was written."""
        path = self._state_path()
        points = json.loads(path.read_text()).get("resume_points", {}) if path.exists() else {}
        if step:
            if str(step) not in points:
                raise ValueError(
                    f"no orchestrator state for step {step} in {path} (it has steps {sorted(map(int, points))})"
                )
            self.sampler.resume(points[str(step)])
        return {k: v for k, v in points.items() if int(k) <= step}

    def _open_step_files(self, resume_step: int) -> None:
        """The per-step record files, without records past the step resumed from."""
        for name in PER_STEP_FILES:
            keep_steps_up_to(self.run_dir / name, resume_step)
        self._metrics_out = JsonlWriter(self.run_dir / ORCHESTRATOR_METRICS_FILE)
        self._rollouts_out = JsonlWriter(self.run_dir / ROLLOUTS_FILE) if self.config.log_samples else None

    def _close_step_files(self) -> None:
        self._metrics_out.close()
        if self._rollouts_out is not None:
            self._rollouts_out.close()

    async def _train_step(self, step: int, points: dict[str, Any]) -> dict[str, Any]:
        """Assemble, record and write batch `step`; its metrics record."""
        groups = await self._collect(step)
        samples, records = self._samples(groups)
        ranks = pack_batch(samples, self.config.seq_len, self.config.trainer_ranks, self.config.micro_batch_rows)
        for group in groups:
            self.ledger.settle(group.draw.index)
        # The resume point first: a kill between the two leaves a state for a batch never written, never
        # a batch (and so perhaps a checkpoint) without its state.
        self._save_state(step, points)
        meta = {"num_samples": len(samples), "num_tokens": sum(len(s) for s in samples)}
        write_batch(self.run_dir / "batches", step, ranks, meta)
        record = self._metrics(step, groups, records, samples)
        self._metrics_out.write(record)
        if self._rollouts_out is not None:
            self._log_samples(step, records)
        return record

    async def run(self, resume_step: int = 0) -> None:
        points = self._resume(resume_step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._open_step_files(resume_step)
        self.filling = resume_step + 1
        evals: list[asyncio.Task] = []
        followers = None
        try:
            await self.pool.wait_healthy()
            await self.rollouts.start()
            follower = make_follower(
                self.config.weight_transport, self.pool, self.run_dir, self.config.inference.startup_timeout_s
            )
            await follower.start()
            if self.config.eval.at_start and resume_step == 0:  # before any rollout: no policy moves under it
                await self._online_eval(0)
            followers = asyncio.gather(self._follow_policies(follower), self._producer())
            for step in range(resume_step + 1, self.config.max_steps + 1):
                self.filling = step
                await self._wait_for_policy(step - 1 - self.config.async_level)
                self.stats = StepStats()
                record = await self._train_step(step, points)
                if self.config.eval.interval and step % self.config.eval.interval == 0:
                    evals.append(asyncio.create_task(self._online_eval(step)))
                logger.info(
                    "batch %d/%d  reward %.3f  dropped %s  policy %d  %.1fs",
                    step,
                    self.config.max_steps,
                    record["reward"],
                    dict(self.stats.dropped) or "-",
                    self.pool.version,
                    record["batch_time_s"],
                )
                if followers.done():
                    followers.result()
            for finished in await asyncio.gather(*evals, return_exceptions=True):
                if isinstance(finished, BaseException):
                    raise finished
        finally:
            for task in evals:
                task.cancel()
            if followers is not None:
                followers.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await followers
            self._close_step_files()
            await self.rollouts.close()
            await self.pool.close()


def run(config: OrchestratorConfig) -> int:
    """The `tandem orchestrator` runner."""
    from transformers import AutoTokenizer

    check_sources(config)
    prepare_run_dir(config, "orchestrator")
    start_sandbox(config.sandbox, config.run_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    orchestrator = Orchestrator(config, tokenizer, InferencePool(config.inference))
    asyncio.run(orchestrator.run(config.resume_step))
    return 0
