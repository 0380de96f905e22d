"""Tool-using environments: a multi-turn taskset whose environment runs the tools the model calls.

The model sees the tools in its prompt (the chat template renders `tool_schemas()`), writes calls in its
family's syntax, and each call is answered by a `tool` message: the tool's result, or an error the model can read
(a malformed call, an unknown tool, bad arguments, an exception, a timeout, the episode's call budget spent;
`tandem.envs.tools.ToolBox`). A reply without calls goes to `respond`, which by default ends the episode, so the
last reply is the answer the rubric scores. Every episode counts its calls and failures as the metrics
`tool_calls` and `tool_errors`, in eval traces and RL step records alike (the failures by kind are in the
episode's `ToolBox.stats`, and each one's text in its `tool` message).

The same loop runs in eval, where the OpenAI server has already parsed the reply into `tool_calls` (anything it
could not read stays in the text, and is found here again as a malformed call), and in RL, where the reply is
the engine's raw text, parsed here with `tool_parser`.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.envs.base import Message, Task, maybe_await, metric
from tandem.envs.multiturn import Answer, MultiTurnTaskset
from tandem.envs.tool_parsers import ToolParser, calls_in_reply, parser_for
from tandem.envs.tools import Tool, ToolBox, tool_message

TOOLBOX_KEY = "toolbox"
"""Where an episode's ToolBox lives in its state (made on the first call)."""


class ToolTaskset(MultiTurnTaskset):
    """A multi-turn taskset with tools: implement `tools()` (and `tasks()` and a `@reward`, as for any taskset)."""

    max_turns = 8
    max_tool_calls: int | None = 16
    """Calls one episode may make; later ones are answered with a `budget` error. None: no limit."""
    tool_timeout_s: float | None = 30.0
    """Seconds one call may take (a tool's own `timeout_s` wins)."""
    tool_output_chars: int = 8000
    """A tool's answer is cut to about this many characters (head and tail kept)."""
    tool_parser: str = "hermes"
    """The tool-call syntax of the models this environment trains (`tandem.envs.tool_parsers`); `tandem rl` checks
    it against the chat template's."""

    @abstractmethod
    def tools(self) -> list[Tool | Callable[..., Any]]:
        """The tools of one episode: `Tool`s or plain functions (their schema from type hints and docstring)."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in OpenAI form, as the chat template and `/v1/chat/completions` take them."""
        return self._toolbox().schemas()

    @property
    def parser(self) -> ToolParser:
        return parser_for(self.tool_parser)

    def _toolbox(self) -> ToolBox:
        return ToolBox(
            self.tools(), max_calls=self.max_tool_calls, timeout_s=self.tool_timeout_s, max_chars=self.tool_output_chars
        )

    async def step(self, task: Task, messages: list[Message], state: dict[str, Any]) -> Answer:
        calls = await asyncio.to_thread(calls_in_reply, messages[-1], self.parser)  # a reply's length of work
        if not calls:
            return await maybe_await(self.respond(task, messages, state))
        box = state.setdefault(TOOLBOX_KEY, self._toolbox())
        return [tool_message(await box.execute(call)) for call in calls]

    def respond(self, task: Task, messages: list[Message], state: dict[str, Any]) -> Answer | Awaitable[Answer]:
        """The environment's answer to a reply that calls no tool: None (the default) ends the episode."""
        return None

    @metric
    def tool_calls(self, state: dict[str, Any]) -> float:
        box = state.get(TOOLBOX_KEY)
        return float(box.stats.calls) if box else 0.0

    @metric
    def tool_errors(self, state: dict[str, Any]) -> float:
        box = state.get(TOOLBOX_KEY)
        return float(sum(box.stats.errors.values())) if box else 0.0
