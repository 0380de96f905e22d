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
from tandem.client import RequestError
from tandem.config.orchestrator import OrchestratorConfig, RolloutSamplingConfig
from tandem.envs import Message, MultiTurnTaskset, Task
from tandem.envs.sandbox import start_sandbox
from tandem.envs.tool_env import ToolTaskset
from tandem.files import atomic_write_text
from tandem.images import image_refs, inline_images
from tandem.jsonl import JsonlWriter, keep_steps_up_to
from tandem.orchestrator.advantages import group_advantages, loss_weights
from tandem.orchestrator.batching import TrainSample, pack_batch, replay_overflow
from tandem.orchestrator.episodes import ChatSuffixes, TemplateSuffixError, TokenRollout, token_episode
from tandem.orchestrator.evals import run_online_eval
from tandem.orchestrator.pool import Completion, InferencePool
from tandem.orchestrator.tasks import Draw, DrawLedger, TaskSampler, TrainSource, check_sources, load_sources
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


@dataclass
class Group:
    """The rollouts of one task, scored."""

    draw: Draw
    prompt_ids: list[int]
    completions: list[Completion]
    texts: list[str]  # each completion decoded, as it was scored
    rewards: list[float]
    metrics: list[dict[str, float]]
    conversations: list[list[Message]] | None = None
    """Multi-turn groups: each episode's messages after the prompt (replies, the environment's answers, tool calls
    and results), as `rollouts.jsonl` shows them."""
    images: tuple[str, ...] = ()
    """A vision-language prompt's image references (data URLs), which the trainer reads the pixels from."""
    image_spans: tuple[tuple[int, int], ...] = ()
    """Each image's placeholder span in `prompt_ids`, as the server expanded it."""

    @property
    def source(self) -> TrainSource:
        return self.draw.source

    @property
    def oldest_version(self) -> int:
        return min((min(c.versions) for c in self.completions if c.versions), default=0)


NO_SIGNAL_BATCHES = 20
"""Stop when this many batches' worth of groups in a row scored the same within every group (filtered out): the
policy has collapsed (it samples one answer) or the reward never varies, and sampling more will not fill a batch."""


class NoLearningSignal(RunError):
    """Every recent group was filtered out for equal rewards; the message says what to check."""


class PromptsTooLong(RunError):
    """Every recent prompt drawn was too long for seq_len; the message names the source and the lengths."""


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
        self.long_streak = 0  # prompts too long for seq_len drawn since the last one that fit
        self._warned_long: set[str] = set()  # sources a too-long prompt was reported for
        self._suffixes: dict[str, ChatSuffixes] = {}

    # -- producing groups -------------------------------------------------------------------------

    def _prompt_ids(self, task: Task) -> list[int]:
        text = self.tokenizer.apply_chat_template(task.messages(), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _run_group(self, draw: Draw) -> Group | None:
        if isinstance(draw.source.taskset, MultiTurnTaskset):
            if image_refs(draw.task.messages()):
                raise RunError(f"{draw.source.name}: images in multi-turn rollouts are not supported yet")
            return await self._run_episodes(draw)
        source, task = draw.source, draw.task
        prompt_ids = self._prompt_ids(task)
        if not self._prompt_fits(draw, len(prompt_ids)):
            return None
        room = self.config.seq_len - len(prompt_ids)  # a sample is the prompt and its reply, within seq_len
        sampling = source.config.sampling
        if sampling.max_tokens > room:
            sampling = sampling.model_copy(update={"max_tokens": room})
        images = image_refs(inline_images(task.messages()))  # files an environment names, read here
        timeout = source.taskset.timeout_s
        seed = self.config.seed + draw.index
        try:
            prompt_ids, spans, completions = await asyncio.wait_for(
                self._generate(prompt_ids, images, sampling, seed), timeout
            )
        except TimeoutError:
            self.stats.dropped["timeout"] += 1
            return None
        except RequestError as error:
            logger.warning("rollout group failed: %s", error)
            self.stats.dropped["error"] += 1
            return None
        longest = max(len(c.token_ids) for c in completions)
        if images and not self._prompt_fits(draw, len(prompt_ids), longest):  # with its images' tokens
            return None
        texts, rewards, metrics = [], [], []
        for completion in completions:
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            score = await source.taskset.score(task, text)
            texts.append(text)
            rewards.append(score.reward)
            metrics.append({**score.metrics, "truncated": float(completion.finish_reason == "length")})
        return Group(
            draw, prompt_ids, completions, texts, rewards, metrics, images=tuple(images), image_spans=tuple(spans)
        )

    async def _generate(
        self, prompt_ids: list[int], images: list[str], sampling: RolloutSamplingConfig, seed: int
    ) -> tuple[list[int], list[tuple[int, int]], list[Completion]]:
        """A group's completions, with the prompt as it ran and its images' spans when it has images."""
        if not images:
            return prompt_ids, [], await self.pool.generate(prompt_ids, sampling, self.config.group_size, seed=seed)
        return await self.pool.generate_with_images(prompt_ids, images, sampling, self.config.group_size, seed)

    def _prompt_fits(self, draw: Draw, prompt_tokens: int, reply_tokens: int = 1) -> bool:
        """Whether a prompt and a reply fit seq_len. A prompt that leaves no room for a reply is skipped before
        it is sampled (a prompt whose images the server expanded, once it is), counted as
        `dropped/prompt_too_long` and reported once per source; a run whose prompts are all too long stops with
        `PromptsTooLong` rather than draw forever."""
        seq_len = self.config.seq_len
        if prompt_tokens + reply_tokens <= seq_len:
            self.long_streak = 0
            return True
        self.stats.dropped["prompt_too_long"] += 1
        self.long_streak += 1
        name = draw.source.name
        if self.long_streak >= NO_SIGNAL_BATCHES * self.per_batch:
            raise PromptsTooLong(
                f"the last {self.long_streak} prompts drawn did not fit seq_len {seq_len} with a reply "
                f"(the last, task {draw.task.id!r} of source {name!r}, is {prompt_tokens} tokens): raise seq_len "
                "or select shorter tasks"
            )
        if name not in self._warned_long:
            self._warned_long.add(name)
            logger.warning(
                "source %s: the prompt of task %r is %d tokens, so with a reply it does not fit seq_len %d: "
                "skipped, as every such prompt will be (counted as dropped/prompt_too_long); raise seq_len to "
                "train on them",
                name,
                draw.task.id,
                prompt_tokens,
                seq_len,
            )
        return False

    def suffixes(self, source: TrainSource) -> ChatSuffixes:
        """The chat template's suffixes for a multi-turn source's rollouts, with its tools rendered."""
        if source.name not in self._suffixes:
            taskset = source.taskset
            tools = taskset.tool_schemas() if isinstance(taskset, ToolTaskset) else None
            parser = taskset.tool_parser if isinstance(taskset, ToolTaskset) else None
            self._suffixes[source.name] = ChatSuffixes(self.tokenizer, tools, parser)
        return self._suffixes[source.name]

    def check_sources(self) -> None:
        """Fail before any rollout if a multi-turn source's answers (or tools) cannot be rendered as suffixes."""
        for source in self.sampler.sources:
            if isinstance(source.taskset, MultiTurnTaskset):
                try:
                    self.suffixes(source)
                except TemplateSuffixError as error:
                    raise TemplateSuffixError(f"source {source.name!r}: {error}") from None

    async def _run_episodes(self, draw: Draw) -> Group | None:
        """A multi-turn group: `group_size` episodes, each generated turn by turn from its exact ids
        (`orchestrator.episodes`). A group with a timed-out or failed episode is dropped, never trained."""
        source, task = draw.source, draw.task
        if not self._prompt_fits(draw, len(self.suffixes(source).prompt_ids(task.messages()))):
            return None
        sampling = source.config.sampling
        base_seed = self.config.seed + draw.index

        def generate_for(member: int):
            turn = 0

            async def generate(prompt_ids: list[int], max_tokens: int) -> Completion:
                nonlocal turn
                turn += 1
                seed = base_seed + 7919 * (member + 1) + 104729 * turn  # distinct per member and turn, repeatable
                limited = sampling.model_copy(update={"max_tokens": max_tokens})
                return (await self.pool.generate(prompt_ids, limited, 1, seed=seed))[0]

            return generate

        episodes = [
            token_episode(source.taskset, task, self.suffixes(source), generate_for(member), sampling.max_tokens,
                          self.config.seq_len)
            for member in range(self.config.group_size)
        ]  # fmt: skip
        try:
            rollouts: list[TokenRollout] = await asyncio.gather(*episodes)
        except RequestError as error:
            logger.warning("rollout group failed: %s", error)
            self.stats.dropped["error"] += 1
            return None
        if any(r.outcome == "timeout" for r in rollouts):
            self.stats.dropped["timeout"] += 1
            return None
        completions = [
            Completion(
                r.completion_ids, r.logprobs, r.versions, "length" if r.outcome == "truncated" else "stop",
                r.kept_ids if r.any_kept_ids else None, r.trained,
            )
            for r in rollouts
        ]  # fmt: skip
        texts = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=False) for r in rollouts]
        metrics = [
            {**r.metrics, "truncated": float(r.outcome == "truncated"), "turns": float(r.turns)} for r in rollouts
        ]
        rewards = [r.reward for r in rollouts]
        return Group(draw, rollouts[0].prompt_ids, completions, texts, rewards, metrics, [r.messages for r in rollouts])

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
                in_flight[asyncio.create_task(self._run_group(draw))] = target, draw
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
                if group is None:
                    self.assigned[target] -= 1  # errored or timed out: sample a replacement
                    self.ledger.settle(draw.index)
                else:
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
        samples, records, prompt_of = [], [], []
        advantage = self.config.advantage
        for index, group in enumerate(groups):
            lengths = [len(c.token_ids) for c in group.completions]
            advantages = group_advantages(group.rewards, lengths, advantage.baseline, advantage.normalize_std)
            temperature = group.source.config.sampling.temperature
            for member, (completion, reward, adv) in enumerate(
                zip(group.completions, group.rewards, advantages, strict=True)
            ):
                samples.append(
                    TrainSample(
                        group.prompt_ids,
                        completion.token_ids,
                        completion.logprobs,
                        adv,
                        0.0,
                        temperature,
                        completion.versions,
                        completion.kept_ids,
                        completion.trained,
                        group.images,
                        tuple((start, end) for start, end in group.image_spans),
                    )
                )
                prompt_of.append(index)
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
        targets = [len(s.completion_ids) if s.trained is None else sum(s.trained) for s in samples]
        weights = loss_weights(targets, prompt_of, advantage.aggregation)
        for sample, weight in zip(samples, weights, strict=True):
            sample.weight = weight
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
            "prompt": self.tokenizer.decode(group.prompt_ids),
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
        self.check_sources()
        points = self._resume(resume_step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._open_step_files(resume_step)
        self.filling = resume_step + 1
        evals: list[asyncio.Task] = []
        followers = None
        try:
            await self.pool.wait_healthy()
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
