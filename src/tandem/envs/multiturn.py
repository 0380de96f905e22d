"""The turn protocol: model replies, the environment answers or stops, until `max_turns` or the timeout.

`run_episode` is the one rollout loop that eval and the orchestrator share;
they differ only in the `generate` callable (an OpenAI client, or the token-in
endpoint that also records token ids and logprobs).
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tandem.envs.base import Message, Score, Task, Taskset, maybe_await

Generate = Callable[[list[Message]], Awaitable[str | Message]]
"""Given the conversation so far, the model's next reply: its text, or a full assistant message."""

EpisodeOutcome = Literal["ok", "truncated", "timeout"]
"""How an episode ended: played out, cut by the context (`ContextFull`), or out of time."""

Answer = str | Message | list[Message] | None
"""What an environment says after a reply: a user message's text, one message, several, or None (the end; so does an
empty list)."""


class ContextFull(Exception):
    """Raised by a `generate` whose conversation no longer fits the model's context: the episode ends there as
    `truncated`, and is scored like any other."""


class MultiTurnTaskset(Taskset):
    """A taskset whose environment reacts to each reply (games, tools, feedback)."""

    max_turns: int = 10
    """Most model replies in one rollout; reaching it without the env stopping is `truncated`."""

    @abstractmethod
    def step(self, task: Task, messages: list[Message], state: dict[str, Any]) -> Answer | Awaitable[Answer]:
        """React to the last assistant message in `messages`: the next user message (a str), any other message
        (e.g. `{"role": "tool", ...}`), several messages (a list: one `tool` answer per call), or None to end
        the rollout. May be async."""


@dataclass(frozen=True)
class Episode:
    """A finished rollout at message level: the conversation, final state, how it ended, its score."""

    task: Task
    completion: list[Message]
    """Every message after the prompt: the model's replies and the environment's answers."""
    state: dict[str, Any]
    outcome: EpisodeOutcome
    score: Score

    @property
    def messages(self) -> list[Message]:
        """The whole conversation, prompt included."""
        return self.task.messages() + self.completion


def _as_message(reply: str | Message, role: str) -> Message:
    return {"role": role, "content": reply} if isinstance(reply, str) else dict(reply)


def _as_messages(answer: str | Message | list[Message]) -> list[Message]:
    return [dict(m) for m in answer] if isinstance(answer, list) else [_as_message(answer, "user")]


async def _play(
    taskset: Taskset,
    task: Task,
    generate: Generate,
    prompt: Sequence[Message],
    after: list[Message],
    state: dict[str, Any],
) -> EpisodeOutcome:
    """Run turns, appending to `after` in place so a timeout keeps the partial conversation."""
    multi = isinstance(taskset, MultiTurnTaskset)
    max_turns = taskset.max_turns if multi else 1
    for turn in range(max_turns):
        try:
            reply = await generate([*prompt, *after])
        except ContextFull:
            return "truncated"
        after.append(_as_message(reply, "assistant"))
        if not multi:
            return "ok"
        answer = await maybe_await(taskset.step(task, [*prompt, *after], state))
        if answer is None or answer == []:
            return "ok"
        if turn + 1 < max_turns:  # a reply nobody will answer stays out of the conversation
            after += _as_messages(answer)
    return "truncated"


async def run_episode(taskset: Taskset, task: Task, generate: Generate) -> Episode:
    """Roll out `task` under `taskset.timeout_s`, then score it (timed-out rollouts are scored too)."""
    state = taskset.init_state(task)
    after: list[Message] = []
    deadline = asyncio.timeout(taskset.timeout_s)
    try:
        async with deadline:
            outcome = await _play(taskset, task, generate, task.messages(), after, state)
    except TimeoutError:
        if not deadline.expired():
            raise  # a TimeoutError from inside generate or step, not ours
        outcome = "timeout"
    score = await taskset.score(task, after, state)
    return Episode(task=task, completion=after, state=state, outcome=outcome, score=score)
