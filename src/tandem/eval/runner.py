"""Roll out every (source, task, rollout) through one concurrency limiter, score it, append its trace.

Single- and multi-turn tasksets alike go through `tandem.envs.run_episode`;
only the `generate` callable is ours (a chat request, with a tool taskset's
`tools`, which the server renders and parses calls for). A verifiers source's
rollout is a verifiers episode against the same server (`tandem.eval.verifiers`),
recorded in the same shape. A rollout never raises:
a failure becomes its outcome (`timeout` for a request that ran out of time,
`error` for anything else) so one bad request cannot stop an eval. A conversation that
outgrows the model's context (the server's 400 says so) is no failure: the episode ends
there as `truncated` and is scored, as in training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tandem.client import ChatCompletion, OpenAIClient, RequestError
from tandem.config import ConfigError
from tandem.config.eval import EvalSourceConfig, SamplingConfig
from tandem.envs import ContextFull, Message, Task, Taskset, apply_select, load_env, run_episode, source_errors
from tandem.envs.tool_env import ToolTaskset
from tandem.envs.verifiers import VerifiersEnv
from tandem.eval.concurrency import AdaptiveLimiter
from tandem.eval.traces import trace_key
from tandem.eval.verifiers import verifiers_rollout
from tandem.images import inline_images
from tandem.jsonl import JsonlWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSource:
    """An eval source ready to run: its config, its taskset and the tasks its `select` picked."""

    config: EvalSourceConfig
    taskset: Taskset | VerifiersEnv
    tasks: list[Task]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def expected(self) -> int:
        return len(self.tasks) * self.config.rollouts_per_task


def load_source(config: EvalSourceConfig) -> EvalSource:
    """Build the taskset and select its tasks; a problem with either is a config error naming the source."""
    with source_errors(config.name):
        if config.verifiers is not None:
            env = VerifiersEnv.load(config.name, config)
            return EvalSource(config, env, env.select(config.select))
        taskset = load_env(config)
        tasks = apply_select(taskset, config.select)
    if not isinstance(tasks, list):
        raise ConfigError(
            f"source {config.name!r}: taskset {config.id!r} is infinite; bound it with select.limit "
            "(or args.num_tasks, or an include range)"
        )
    return EvalSource(config, taskset, tasks)


@dataclass(frozen=True)
class EvalRollout:
    """One rollout to run: the `index`-th of `task` from `source` (the index offsets its seed and keys its trace)."""

    source: EvalSource
    task: Task
    index: int

    @property
    def key(self) -> str:
        return trace_key(self.source.name, self.task.id, self.index)


def request_fields(sampling: SamplingConfig, rollout: int) -> dict[str, Any]:
    """The sampling fields of a request for rollout `rollout` of a task (its seed is offset by the index)."""
    fields: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.seed is not None:
        fields["seed"] = sampling.seed + rollout
    if sampling.stop:
        fields["stop"] = sampling.stop
    return {**fields, **sampling.extra}


async def run_rollout(client: OpenAIClient, model: str, rollout: EvalRollout) -> dict[str, Any]:
    """Roll out, score and describe one rollout as its trace record."""
    task, taskset = rollout.task, rollout.source.taskset
    sampling = request_fields(rollout.source.config.sampling, rollout.index)
    if isinstance(taskset, VerifiersEnv):
        started = time.monotonic()
        try:
            episode = await verifiers_rollout(taskset, task, sampling, client.base_url, client.api_key, model)
        except Exception as failure:  # a bug, not the model: verifiers turns the episode's own failures into errors
            episode = _failed(task, [], time.monotonic() - started, f"{type(failure).__name__}: {failure}")
    else:
        episode = await _native_rollout(client, model, taskset, task, sampling)
    return {
        "key": rollout.key,
        "source": rollout.source.name,
        "task": task.model_dump(mode="json", exclude={"prompt"}),
        "rollout": rollout.index,
        **episode,
        "model": model,
        "sampling": sampling,
        "finished_at": time.time(),
    }


async def _native_rollout(
    client: OpenAIClient, model: str, taskset: Taskset, task: Task, sampling: dict[str, Any]
) -> dict[str, Any]:
    """A tandem taskset's episode of `task` through `run_episode`: the record's episode fields."""
    tools = {"tools": taskset.tool_schemas()} if isinstance(taskset, ToolTaskset) else {}
    replies: list[ChatCompletion] = []
    conversation: list[Message] = task.messages()  # the latest one, kept when a request fails

    async def generate(messages: list[Message]) -> Message:
        nonlocal conversation
        conversation = messages
        try:
            reply = await client.chat(inline_images(messages), model=model, **sampling, **tools)
        except RequestError as failure:
            if failure.context_full:  # the conversation outgrew the context: the episode ends, truncated
                raise ContextFull(failure.server_message) from failure
            raise
        replies.append(reply)
        message = {key: value for key, value in reply.choices[0].message.items() if value is not None}
        conversation = [*messages, message]
        return message

    started = time.monotonic()
    try:
        episode = await run_episode(taskset, task, generate)
    except RequestError as failure:
        outcome = "timeout" if failure.kind == "timeout" else "error"
        latency = time.monotonic() - started
        return _failed(task, conversation, latency, str(failure), replies, outcome=outcome, attempts=failure.attempts)
    except Exception as failure:  # the environment's step or scoring failed: this rollout only
        return _failed(task, conversation, time.monotonic() - started, f"{type(failure).__name__}: {failure}", replies)
    outcome = episode.outcome
    if outcome == "ok" and any(r.choices[0].finish_reason == "length" for r in replies):
        outcome = "truncated"
    scored = outcome != "timeout"
    return {
        "prompt": task.messages(),
        "completion": episode.completion,
        "reward": episode.score.reward if scored else 0.0,
        "metrics": episode.score.metrics if scored else {},
        "outcome": outcome,
        "error": None,
        **_usage(replies),
        "latency_s": time.monotonic() - started,
    }


def _usage(replies: list[ChatCompletion]) -> dict[str, Any]:
    return {
        "tokens": {
            "prompt": sum(r.prompt_tokens for r in replies),
            "completion": sum(r.completion_tokens for r in replies),
        },
        "turns": len(replies),
        "attempts": sum(r.attempts for r in replies),
    }


def _failed(
    task: Task,
    conversation: list[Message],
    latency_s: float,
    error: str,
    replies: list[ChatCompletion] = (),
    *,
    outcome: str = "error",
    attempts: int = 0,
) -> dict[str, Any]:
    """The episode fields of a rollout that failed with `error` (unscored), `conversation` the last one it had;
    `attempts` are those of the request that failed, beyond its replies'."""
    usage = _usage(list(replies))
    return {
        "prompt": task.messages(),
        "completion": conversation[len(task.messages()) :],
        "reward": 0.0,
        "metrics": {},
        "outcome": outcome,
        "error": error,
        **usage,
        "attempts": usage["attempts"] + attempts,
        "latency_s": latency_s,
    }


async def run_rollouts(
    rollouts: list[EvalRollout],
    client: OpenAIClient,
    model: str,
    limiter: AdaptiveLimiter,
    writer: JsonlWriter,
    on_record: Callable[[dict[str, Any]], None] = lambda record: None,
) -> None:
    """Run `rollouts` with at most `limiter.limit` in flight, appending each trace as it finishes.

    The first error of each source is logged as a warning (later ones at debug level: the summary counts them).
    """
    warned: set[str] = set()

    async def one(rollout: EvalRollout) -> None:
        concurrency = limiter.limit
        try:
            record = await run_rollout(client, model, rollout)
        finally:
            limiter.release()
        record["concurrency"] = concurrency
        writer.write(record)
        if record["outcome"] == "error":
            log = logger.debug if rollout.source.name in warned else logger.warning
            warned.add(rollout.source.name)
            name, task_id = rollout.source.name, rollout.task.id
            log("%s: task %s rollout %d failed: %s", name, task_id, rollout.index, record["error"])
        on_record(record)

    async with asyncio.TaskGroup() as group:
        for rollout in rollouts:
            await limiter.acquire()
            group.create_task(one(rollout))


@contextlib.asynccontextmanager
async def serving(sources: list[EvalSource]) -> AsyncIterator[None]:
    """What the sources' rollouts need up while they run: each verifiers env's serving resources (its
    interception server, shared tool servers)."""
    async with contextlib.AsyncExitStack() as stack:
        for source in sources:
            if isinstance(source.taskset, VerifiersEnv):
                await stack.enter_async_context(source.taskset.serving())
        yield


def pending_rollouts(sources: list[EvalSource], done: set[str]) -> list[EvalRollout]:
    """Every rollout of every source whose key is not in `done`, source by source, a task's rollouts together."""
    everything = (
        EvalRollout(source, task, index)
        for source in sources
        for task in source.tasks
        for index in range(source.config.rollouts_per_task)
    )
    return [rollout for rollout in everything if rollout.key not in done]
