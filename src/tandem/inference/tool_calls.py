"""OpenAI function tools on /v1/chat/completions: the request's `tools` and `tool_choice` checked, a
conversation's tool calls as chat templates read them, and a reply's tool calls as OpenAI returns them.

The model writes calls in its family's syntax and `tandem.envs.tool_parsers` reads them (the parser chosen by
the chat template's markers). Decoding is not constrained: a named `tool_choice` renders only that tool, so the
model is asked for it, but a reply without a call is returned as text. Blocks that fail to parse stay in the
content, so a client sees what the model wrote instead of losing it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.envs import bounded_json
from tandem.envs.tool_parsers import ToolParser, format_tool_calls, parser_for

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def checked_tools(tools: Sequence[Any] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the chat template renders (None: none), after checking each schema and the choice; a bad one
    raises ValueError with the field it is about."""
    tools = list(tools or [])
    names = [_tool_name(i, tool) for i, tool in enumerate(tools)]
    if len(set(names)) < len(names):
        raise ValueError(f"tools: two tools share a name: {sorted(n for n in set(names) if names.count(n) > 1)}")
    if tool_choice is None or tool_choice == "auto":
        return tools or None
    if tool_choice == "none":
        return None
    if not (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"):
        raise ValueError(
            'tool_choice: expected "auto", "none" or {"type": "function", "function": {"name": ...}}, '
            f"got {json.dumps(tool_choice, default=str)}"
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if name not in names:
        raise ValueError(f"tool_choice: {name!r} is not one of the request's tools: {names}")
    return [tools[names.index(name)]]


def _tool_name(index: int, tool: Any) -> str:
    """A tool's name once its schema is an OpenAI function tool (type, a valid name, object parameters)."""
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise ValueError(f'{where}: expected {{"type": "function", "function": {{...}}}}; only function tools exist')
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function: expected an object with a name and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name: {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$")
    if not isinstance(function.get("description", ""), str):
        raise ValueError(f"{where}.function.description: must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ValueError(f'{where}.function.parameters: must be a JSON schema object ({{"type": "object", ...}})')
    if not isinstance(parameters.get("properties", {}), Mapping):
        raise ValueError(f"{where}.function.parameters.properties: must be an object of property schemas")
    return name


def template_message(message: dict[str, Any], where: str = "message") -> dict[str, Any]:
    """A request message as chat templates read it: an assistant's `tool_calls` arguments as an object (OpenAI
    sends a JSON string; templates such as Qwen's `tojson` them, which would quote the string again). Arguments
    that are not JSON are rendered as the text they are; ones nested too deep or with too long a number
    (`tandem.envs.bounded_json`) raise ValueError naming the field (`where`: the message's)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_template_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]}


def _template_call(call: Any, where: str) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = bounded_json.loads(arguments) if arguments.strip() else {}
    except bounded_json.JsonTooLarge as error:
        raise ValueError(f"{where}.function.arguments: {error}") from None
    except bounded_json.JsonRefused:
        return call  # the template renders the text as it came
    return {**call, "function": {**function, "arguments": parsed}}


def reply_parser(chat_template: str | None) -> ToolParser:
    """The parser for the tool-call syntax the chat template renders; ValueError if none knows it."""
    return parser_for(chat_template or "")


def tool_reply(text: str, parser: ToolParser) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A reply's content (the text outside calls, malformed blocks included; None if empty) and its OpenAI
    `tool_calls` (None without any)."""
    parsed = parser.parse(text)
    content = "\n".join(part for part in (parsed.content, *(e.text for e in parsed.errors)) if part)
    return content or None, format_tool_calls(parsed.calls) or None


def finish_reason(calls: list[dict[str, Any]] | None, engine_reason: str) -> str:
    """`tool_calls` for a reply that ended on its own with calls; a cut-off reply keeps `length` or `abort`."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


class ToolStream:
    """One streamed choice's text with tools on: content deltas pass through until a call may begin (the open
    tag, or a prefix of it at the end), then the rest is held and parsed when the choice finishes; the calls go
    out in that last delta. Held text is kept as its pieces and joined once, so a long reply costs its length."""

    def __init__(self, parser: ToolParser, open_tag: str = "<tool_call>") -> None:
        self.parser, self.open_tag = parser, open_tag
        self.held: list[str] = []
        self.calling = False

    def update(
        self, text: str, engine_reason: str | None
    ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """This update's delta: the content to send now, the calls (each with its stream `index`; only in the
        last delta) and the finish reason."""
        sent = self._feed(text)
        if engine_reason is None:
            return sent, None, None
        held, self.held = "".join(self.held), []
        rest, calls = tool_reply(held, self.parser) if self.calling else (held, None)
        content = sent + (rest or "")
        indexed = None if calls is None else [{"index": i, **call} for i, call in enumerate(calls)]
        return content, indexed, finish_reason(calls, engine_reason)

    def _feed(self, text: str) -> str:
        self.held.append(text)
        if self.calling:
            return ""
        pending = "".join(self.held)  # a prefix of the open tag at most, and this update's text
        start = pending.find(self.open_tag)
        if start != -1:
            self.calling = True
            self.held = [pending[start:]]
            return pending[:start]
        keep = next((k for k in range(len(self.open_tag) - 1, 0, -1) if pending.endswith(self.open_tag[:k])), 0)
        cut = len(pending) - keep
        self.held = [pending[cut:]]
        return pending[:cut]
