"""One task's group of rollouts, generated and scored: `Rollouts.roll(draw)`.

A single-turn source's group is one `/generate` request for `group_size` completions of the task's rendered
prompt; a multi-turn source's is `group_size` episodes, each generated turn by turn from its exact ids
(`orchestrator.episodes`). Either way a prompt that leaves no room for a reply within seq_len is skipped before
it is sampled, and a group that times out or fails is dropped, never trained: `roll` says why (`DropReason`) and
the loop that called it draws a replacement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.client import RequestError
from tandem.config.orchestrator import RolloutSamplingConfig
from tandem.envs import Message, MultiTurnTaskset, Task
from tandem.envs.tool_env import ToolTaskset
from tandem.envs.verifiers import VerifiersEnv
from tandem.images import image_refs, inline_images
from tandem.orchestrator.episodes import ChatSuffixes, TemplateSuffixError, TokenRollout, token_episode
from tandem.orchestrator.pool import Completion, InferencePool
from tandem.orchestrator.tasks import Draw, TrainSource
from tandem.orchestrator.token_gateway import TokenGateway
from tandem.orchestrator.verifiers_rollouts import episode_sampling, run_episodes
from tandem.run import RunError
from tandem.wire.protocol import SamplingParams

logger = logging.getLogger(__name__)

DropReason = Literal["timeout", "error", "prompt_too_long"]
"""Why a draw gave no group: counted as `dropped/<reason>` in the step's metrics."""


class PromptsTooLong(RunError):
    """Every recent prompt drawn was too long for seq_len; the message names the source and the lengths."""


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
    member_prompts: list[list[int]] | None = None
    """Groups whose members have prompts of their own (a verifiers source's branches): each member's prompt."""
    failed: Counter[str] = field(default_factory=Counter)
    """Rollouts of the group that do not train, by outcome (a verifiers trace that errored or timed out)."""

    @property
    def source(self) -> TrainSource:
        return self.draw.source

    def prompt_of(self, member: int) -> list[int]:
        return self.prompt_ids if self.member_prompts is None else self.member_prompts[member]

    @property
    def oldest_version(self) -> int:
        return min((min(c.versions) for c in self.completions if c.versions), default=0)


def sampling_params(sampling: RolloutSamplingConfig, *, max_tokens: int, seed: int) -> SamplingParams:
    """A source's sampling settings as the request carries them, with this request's token budget and seed.

    The config's fields are the wire's by name, so none is copied by hand (and one the wire lacks is an error
    here, not a setting silently left out)."""
    return SamplingParams(**{**sampling.model_dump(), "max_tokens": max_tokens, "seed": seed})


class Rollouts:
    """Generates and scores the groups of a run's sources against `pool`.

    `seq_len` bounds a prompt and its replies, `group_size` is the completions per task, and draw `i` samples
    with seed `seed + i` (so a group drawn again on resume samples the same). `max_long_streak` prompts in a row
    too long for seq_len stop the run (`PromptsTooLong`) rather than draw forever. A multi-turn source whose chat
    template cannot render its answers (or tools) as suffixes fails here, before any rollout.
    """

    def __init__(
        self,
        tokenizer: Any,
        pool: InferencePool,
        sources: Sequence[TrainSource],
        *,
        seq_len: int,
        group_size: int,
        seed: int,
        max_long_streak: int,
    ) -> None:
        self.tokenizer, self.pool = tokenizer, pool
        self.seq_len, self.group_size, self.seed = seq_len, group_size, seed
        self.max_long_streak = max_long_streak
        self._suffixes = {s.name: _suffixes(tokenizer, s) for s in sources if isinstance(s.taskset, MultiTurnTaskset)}
        self._long_streak = 0  # prompts too long for seq_len drawn since the last one that fit
        self._warned_long: set[str] = set()  # sources a too-long prompt was reported for
        self._source_index = {s.name: index for index, s in enumerate(sources)}
        verifiers = [s for s in sources if isinstance(s.taskset, VerifiersEnv)]
        self._verifiers_envs = [s.taskset for s in verifiers]
        self.gateway = (
            TokenGateway(pool, [s.config.sampling for s in sources], model_name="policy", seq_len=seq_len)
            if verifiers
            else None
        )
        self._failed_streak = 0  # verifiers groups in a row with nothing to train
        self._serving = contextlib.AsyncExitStack()

    async def start(self) -> None:
        """Bring up what the verifiers sources' episodes need: the token gateway, each env's serving resources."""
        if self.gateway is None:
            return
        await self.gateway.start()
        self._serving.push_async_callback(self.gateway.stop)
        for env in self._verifiers_envs:
            await self._serving.enter_async_context(env.serving())

    async def close(self) -> None:
        await self._serving.aclose()

    async def roll(self, draw: Draw) -> Group | DropReason:
        """The scored group of `draw`, or why it has none."""
        if isinstance(draw.source.taskset, VerifiersEnv):
            return await self._verifiers(draw)
        if isinstance(draw.source.taskset, MultiTurnTaskset):
            if image_refs(draw.task.messages()):
                raise RunError(f"{draw.source.name}: images in multi-turn rollouts are not supported yet")
            return await self._episodes(draw)
        return await self._single_turn(draw)

    def _prompt_ids(self, task: Task) -> list[int]:
        text = self.tokenizer.apply_chat_template(task.messages(), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _single_turn(self, draw: Draw) -> Group | DropReason:
        """`group_size` completions of the task's prompt in one request, each decoded and scored."""
        source, task = draw.source, draw.task
        prompt_ids = self._prompt_ids(task)
        if not self._prompt_fits(draw, len(prompt_ids)):
            return "prompt_too_long"
        room = self.seq_len - len(prompt_ids)  # a sample is the prompt and its reply, within seq_len
        sampling = source.config.sampling
        params = sampling_params(sampling, max_tokens=min(sampling.max_tokens, room), seed=self.seed + draw.index)
        images = image_refs(inline_images(task.messages()))  # files an environment names, read here
        try:
            prompt_ids, spans, completions = await asyncio.wait_for(
                self._generate(prompt_ids, images, params), source.taskset.timeout_s
            )
        except TimeoutError:
            return "timeout"
        except RequestError as error:
            logger.warning("rollout group failed: %s", error)
            return "error"
        longest = max(len(c.token_ids) for c in completions)
        if images and not self._prompt_fits(draw, len(prompt_ids), longest):  # with its images' tokens
            return "prompt_too_long"
        texts, rewards, metrics = [], [], []
        for completion in completions:
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            score = await source.taskset.score(task, text)
            texts.append(text)
            rewards.append(score.reward)
            metrics.append({**score.metrics, "truncated": float(completion.finish_reason == "length")})
        return Group(
            draw,
            prompt_ids,
            completions,
            texts,
            rewards,
            metrics,
            images=tuple(images),
            image_spans=tuple((start, end) for start, end in spans),
        )

    async def _generate(
        self, prompt_ids: list[int], images: list[str], params: SamplingParams
    ) -> tuple[list[int], list[tuple[int, int]], list[Completion]]:
        """A group's completions, with the prompt as it ran and its images' spans when it has images."""
        if not images:
            return prompt_ids, [], await self.pool.generate(prompt_ids, params, self.group_size)
        return await self.pool.generate_with_images(prompt_ids, images, params, self.group_size)

    async def _episodes(self, draw: Draw) -> Group | DropReason:
        """A multi-turn group: `group_size` episodes, each generated turn by turn from its exact ids. A group with a
        timed-out or failed episode is dropped."""
        source, task = draw.source, draw.task
        suffixes = self._suffixes[source.name]
        if not self._prompt_fits(draw, len(suffixes.prompt_ids(task.messages()))):
            return "prompt_too_long"
        sampling = source.config.sampling
        base_seed = self.seed + draw.index

        def generate_for(member: int):
            turn = 0

            async def generate(prompt_ids: list[int], max_tokens: int) -> Completion:
                nonlocal turn
                turn += 1
                seed = base_seed + 7919 * (member + 1) + 104729 * turn  # distinct per member and turn, repeatable
                params = sampling_params(sampling, max_tokens=max_tokens, seed=seed)
                return (await self.pool.generate(prompt_ids, params, 1))[0]

            return generate

        episodes = [
            token_episode(source.taskset, task, suffixes, generate_for(member), sampling.max_tokens, self.seq_len)
            for member in range(self.group_size)
        ]
        try:
            rollouts: list[TokenRollout] = await asyncio.gather(*episodes)
        except RequestError as error:
            logger.warning("rollout group failed: %s", error)
            return "error"
        if any(r.outcome == "timeout" for r in rollouts):
            return "timeout"
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

    async def _verifiers(self, draw: Draw) -> Group | DropReason:
        """`group_size` verifiers episodes of the task, sampled through the gateway; each trainable branch is a
        member (`verifiers_rollouts`). A run whose groups all fail stops, with the error, after
        `max_long_streak` of them."""
        assert self.gateway is not None
        source, env = draw.source, draw.source.taskset
        assert isinstance(env, VerifiersEnv)
        base_url = self.gateway.base_url(self._source_index[source.name])
        seeds = [(self.seed + draw.index) * 1_000_003 + member for member in range(self.group_size)]
        renderer_model = self.tokenizer.name_or_path
        contexts = [
            env.train_context(base_url, "policy", renderer_model, episode_sampling(source.config.sampling, seed))
            for seed in seeds
        ]
        results = await run_episodes(env, draw.task, contexts, seeds, self.gateway.take)
        if results.outcomes:
            logger.warning(
                "source %s: %s of %d verifiers episodes' traces do not train; the last error: %s",
                source.name,
                dict(results.outcomes),
                self.group_size,
                results.last_error or "none reported",
            )
        if not results.members:
            self._failed_streak += 1
            if self._failed_streak >= self.max_long_streak:
                raise RunError(
                    f"source {source.name!r}: the last {self._failed_streak} groups of verifiers episodes had no "
                    f"trace to train; the last error: {results.last_error or 'none reported'}"
                )
            return "timeout" if results.outcomes["timeout"] > results.outcomes["error"] else "error"
        self._failed_streak = 0
        members = results.members
        completions = [m.completion for m in members]
        return Group(
            draw,
            members[0].prompt_ids,
            completions,
            [self.tokenizer.decode(c.token_ids, skip_special_tokens=False) for c in completions],
            [m.reward for m in members],
            [m.metrics for m in members],
            member_prompts=[m.prompt_ids for m in members],
            failed=results.outcomes,
        )

    def _prompt_fits(self, draw: Draw, prompt_tokens: int, reply_tokens: int = 1) -> bool:
        """Whether a prompt and a reply fit seq_len. A prompt that leaves no room for a reply is skipped before
        it is sampled (a prompt whose images the server expanded, once it is) and reported once per source; a run
        whose prompts are all too long stops with `PromptsTooLong` rather than draw forever."""
        if prompt_tokens + reply_tokens <= self.seq_len:
            self._long_streak = 0
            return True
        self._long_streak += 1
        name = draw.source.name
        if self._long_streak >= self.max_long_streak:
            raise PromptsTooLong(
                f"the last {self._long_streak} prompts drawn did not fit seq_len {self.seq_len} with a reply (the "
                f"last, task {draw.task.id!r} of source {name!r}, is {prompt_tokens} tokens): raise seq_len or "
                "select shorter tasks"
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
                self.seq_len,
            )
        return False


def _suffixes(tokenizer: Any, source: TrainSource) -> ChatSuffixes:
    """The chat template's suffixes for a multi-turn source's rollouts, with its tools rendered."""
    taskset = source.taskset
    tools = taskset.tool_schemas() if isinstance(taskset, ToolTaskset) else None
    parser = taskset.tool_parser if isinstance(taskset, ToolTaskset) else None
    try:
        return ChatSuffixes(tokenizer, tools, parser)
    except TemplateSuffixError as error:
        raise TemplateSuffixError(f"source {source.name!r}: {error}") from None
