"""`tandem orchestrator`: keeps inference busy, scores rollouts, and writes one full batch per trainer step.

The async model (docs/rl.md): batch N trains at step N and produces policy N. Rollout groups for
batch N may start once inference serves a policy >= N - 1 - async_level, so with async_level 1
inference samples batch N+1 while the trainer trains step N. When batch N is assembled, a sample
whose oldest token came from a policy older than N - max_off_policy_steps is dropped. Groups that
error, time out, go stale, or (with filter_zero_advantage) carry no signal are replaced by
sampling more, so every batch has exactly batch_size rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.config.orchestrator import OrchestratorConfig
from tandem.envs import Task
from tandem.eval.client import RequestError
from tandem.files import atomic_write_text
from tandem.jsonl import keep_steps_up_to
from tandem.orchestrator.advantages import group_advantages, loss_weights
from tandem.orchestrator.batching import TrainSample, pack_batch
from tandem.orchestrator.evals import run_online_eval
from tandem.orchestrator.pool import Completion, InferencePool
from tandem.orchestrator.tasks import Source, TaskSampler, load_sources
from tandem.run import prepare_run_dir
from tandem.transport.batches import write_batch
from tandem.transport.broadcast import Rendezvous, announce_path
from tandem.transport.policies import latest_policy, policy_dir

logger = logging.getLogger(__name__)


@dataclass
class Group:
    """The rollouts of one task, scored."""

    source: Source
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float]
    metrics: list[dict[str, float]]

    @property
    def oldest_version(self) -> int:
        return min((min(c.versions) for c in self.completions if c.versions), default=0)


@dataclass
class StepStats:
    dropped: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tokenizer: Any, pool: InferencePool):
        self.config, self.tokenizer, self.pool = config, tokenizer, pool
        self.sampler = TaskSampler(load_sources(config.source), config.seed)
        self.run_dir = config.run_dir
        self.per_batch = config.batch_size // config.group_size
        self.assigned: Counter[int] = Counter()  # groups started or kept for each batch
        self.buckets: dict[int, asyncio.Queue[Group | BaseException]] = {}
        self.filling = 1  # the batch being assembled
        self.stats = StepStats()

    # -- producing groups -------------------------------------------------------------------------

    def _prompt_ids(self, task: Task) -> list[int]:
        text = self.tokenizer.apply_chat_template(task.messages(), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _run_group(self, draw: int) -> Group | None:
        source, task = self.sampler.next()
        sampling = source.config.sampling
        prompt_ids = self._prompt_ids(task)
        timeout = source.taskset.timeout_s
        try:
            completions = await asyncio.wait_for(
                self.pool.generate(prompt_ids, sampling, self.config.group_size, seed=self.config.seed + draw), timeout
            )
        except TimeoutError:
            self.stats.dropped["timeout"] += 1
            return None
        except RequestError as error:
            logger.warning("rollout group failed: %s", error)
            self.stats.dropped["error"] += 1
            return None
        rewards, metrics = [], []
        for completion in completions:
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            score = await source.taskset.score(task, text)
            rewards.append(score.reward)
            metrics.append({**score.metrics, "truncated": float(completion.finish_reason == "length")})
        return Group(source, prompt_ids, completions, rewards, metrics)

    def _bucket(self, step: int) -> asyncio.Queue[Group | BaseException]:
        return self.buckets.setdefault(step, asyncio.Queue())

    def _next_target(self) -> int | None:
        """The earliest batch that still needs a group and that the loaded policy may sample for."""
        newest = min(self.config.max_steps, self.pool.version + 1 + self.config.async_level)
        return next((b for b in range(self.filling, newest + 1) if self.assigned[b] < self.per_batch), None)

    async def _producer(self) -> None:
        """Keep up to `max_concurrent` groups in flight, each meant for one batch within the async bound."""
        in_flight: dict[asyncio.Task, int] = {}
        draw = 0
        while True:
            while len(in_flight) < self.config.inference.max_concurrent and (target := self._next_target()):
                self.assigned[target] += 1
                in_flight[asyncio.create_task(self._run_group(draw))] = target
                draw += 1
            if not in_flight:
                await asyncio.sleep(0.01)
                continue
            done, _ = await asyncio.wait(in_flight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                target = in_flight.pop(task)
                try:
                    group = task.result()
                except BaseException as error:  # a bug, not a bad rollout: surface it
                    await self._bucket(self.filling).put(error)
                    return
                if group is None:
                    self.assigned[target] -= 1  # errored or timed out: sample a replacement
                else:
                    await self._bucket(target).put(group)

    # -- assembling batches -----------------------------------------------------------------------

    def _keep(self, group: Group, step: int) -> bool:
        if step - group.oldest_version > self.config.max_off_policy_steps:
            self.stats.dropped["stale"] += 1
            return False
        if self.config.filter_zero_advantage and max(group.rewards) == min(group.rewards):
            self.stats.dropped["zero_advantage"] += 1
            return False
        return True

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
        del self.buckets[step]
        return groups

    def _samples(self, groups: list[Group]) -> tuple[list[TrainSample], list[dict]]:
        samples, records, prompt_of = [], [], []
        advantage = self.config.advantage
        for index, group in enumerate(groups):
            lengths = [len(c.token_ids) for c in group.completions]
            advantages = group_advantages(group.rewards, lengths, advantage.baseline, advantage.normalize_std)
            temperature = group.source.config.sampling.temperature
            for completion, reward, adv in zip(group.completions, group.rewards, advantages, strict=True):
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
                    )
                )
                prompt_of.append(index)
                records.append(
                    {
                        "source": group.source.name,
                        "reward": reward,
                        "advantage": adv,
                        "tokens": len(completion.token_ids),
                    }
                )
        weights = loss_weights([len(s.completion_ids) for s in samples], prompt_of, advantage.aggregation)
        for sample, weight in zip(samples, weights, strict=True):
            sample.weight = weight
        return samples, records

    def _metrics(self, step: int, groups: list[Group], records: list[dict]) -> dict[str, Any]:
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
            **{f"dropped/{reason}": count for reason, count in self.stats.dropped.items()},
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "completion_tokens": tokens,
            "rollout_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "batch_time_s": elapsed,
            "inference_idle_s": self.pool.idle_s,
            "inference_requests": list(self.pool.requests),
            "policy_version": self.pool.version,
            "time": time.time(),
        }

    # -- policies ---------------------------------------------------------------------------------

    async def _follow_policies(self) -> None:
        """Load each policy the trainer publishes, as soon as it is complete (or, when the trainer broadcasts
        them, follow the version the servers serve)."""
        if self.config.weight_transport == "broadcast":
            while True:
                await self.pool.follow_broadcast()
                await asyncio.sleep(0.05)
        policies = self.run_dir / "policies"
        while True:
            newest = latest_policy(policies)
            if newest > self.pool.version:
                await self.pool.load_policy(policy_dir(policies, newest).resolve(), newest)
            await asyncio.sleep(0.05)

    async def _rendezvous(self) -> Rendezvous:
        """The trainer's weight-broadcast rendezvous, once trainer rank 0 has announced it."""
        path = announce_path(self.run_dir)
        deadline = time.monotonic() + self.config.inference.startup_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the trainer announced no weight broadcast in {path} (is it using weights.transport = broadcast?)"
                )
            await asyncio.sleep(0.1)
        return Rendezvous.model_validate_json(path.read_text())

    async def _wait_for_policy(self, version: int) -> None:
        deadline = time.monotonic() + self.config.policy_timeout_s
        while self.pool.version < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no policy >= {version} from the trainer in {self.config.policy_timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    # -- online evals -----------------------------------------------------------------------------

    def _write_metrics(self, record: dict[str, Any]) -> None:
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()

    async def _online_eval(self, step: int) -> None:
        """Evaluate the policy being served, beside the training rollouts; one `kind = "eval"` record."""
        version, started = self.pool.version, time.monotonic()
        out_dir = self.run_dir / "evals" / f"step-{step:06d}"
        inference = self.config.inference
        metrics = await run_online_eval(self.config.eval, inference.base_urls[0], inference.admin_token, out_dir)
        self._write_metrics(
            {
                "step": step,
                "kind": "eval",
                "policy_version": version,
                **metrics,
                "eval_time_s": time.monotonic() - started,
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
        return self.run_dir / "orchestrator_state.json"

    def _save_state(self, step: int, history: dict[str, Any]) -> None:
        history[str(step)] = self.sampler.state()
        kept = dict(sorted(history.items(), key=lambda item: int(item[0]))[-64:])
        history.clear()
        history.update(kept)
        atomic_write_text(self._state_path(), json.dumps({"sampler": history}))

    def _resume(self, step: int) -> dict[str, Any]:
        """Restore the sampler as it was after batch `step` (the trainer's checkpoint)."""
        history = json.loads(self._state_path().read_text())["sampler"] if self._state_path().exists() else {}
        if step:
            if str(step) not in history:
                raise ValueError(f"no orchestrator state for step {step} in {self._state_path()}")
            self.sampler.load_state(history[str(step)])
        return {k: v for k, v in history.items() if int(k) <= step}

    async def run(self, resume_step: int = 0) -> None:
        history = self._resume(resume_step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await self.pool.wait_healthy()
        if self.config.weight_transport == "broadcast":
            await self.pool.join_broadcast(await self._rendezvous())
        followers = asyncio.gather(self._follow_policies(), self._producer())
        metrics_path = self.run_dir / "orchestrator_metrics.jsonl"
        keep_steps_up_to(metrics_path, resume_step)
        evals: list[asyncio.Task] = []
        try:
            with metrics_path.open("a", encoding="utf-8") as metrics_file:
                self._metrics_file = metrics_file
                for step in range(resume_step + 1, self.config.max_steps + 1):
                    self.filling = step
                    await self._wait_for_policy(step - 1 - self.config.async_level)
                    self.stats = StepStats()
                    groups = await self._collect(step)
                    samples, records = self._samples(groups)
                    ranks = pack_batch(
                        samples, self.config.seq_len, self.config.trainer_ranks, self.config.micro_batch_rows
                    )
                    meta = {"num_samples": len(samples), "num_tokens": sum(len(s) for s in samples)}
                    write_batch(self.run_dir / "batches", step, ranks, meta)
                    self._save_state(step, history)
                    record = self._metrics(step, groups, records)
                    self._write_metrics(record)
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
            followers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await followers
            await self.pool.close()


def run(config: OrchestratorConfig) -> int:
    """The `tandem orchestrator` runner."""
    from transformers import AutoTokenizer

    prepare_run_dir(config, "orchestrator")
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    orchestrator = Orchestrator(config, tokenizer, InferencePool(config.inference))
    asyncio.run(orchestrator.run(config.resume_step))
    return 0
