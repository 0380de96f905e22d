"""Tool calls in a model's reply text: one parser per model family, chosen by model type or chat template.

A parser splits a reply into the message content, the calls, and the blocks it could not read; a malformed
block is an entry in that last list (it goes back to the model as a tool error), never an exception: a reply is
hostile text, so JSON is read with its nesting and numbers bounded (`tandem.envs.bounded_json`) and parsing
takes time linear in the reply's length.
`render` is the inverse: the text a model of the family writes for given calls.

Adding a family: subclass `ToolParser` (a `name`, `parse`, `render`) and register an instance with the model
types (`config.json`'s `model_type`) and chat-template markers that identify it:

    register_tool_parser(MyParser(), model_types=("mistral",), template_markers=("[TOOL_CALLS]",))
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.envs import bounded_json
from tandem.envs.base import Message, last_assistant_text
from tandem.envs.tools import MalformedCall, ToolCall


@dataclass(frozen=True)
class ParsedReply:
    """A reply split up: its text outside tool-call blocks, the calls, and the blocks that failed to parse."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[MalformedCall] = field(default_factory=list)


class ToolParser(ABC):
    """One model family's tool-call syntax."""

    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedReply:
        """Split a reply into content, calls and malformed blocks. The reply is the policy's: never raise (read
        JSON with `bounded_json.loads`), and take time linear in its length."""

    @abstractmethod
    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        """The reply text a model of this family writes for `content` followed by `calls`."""


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    A block without `"arguments"` is a call with none; the content is the text outside the blocks, stripped
    (a `<think>` section stays in it: reasoning is not this parser's business).
    """

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedReply:
        """Linear in the reply's length: each search starts where the last one of its tag ended (a reply of many
        unclosed tags would be quadratic otherwise), and a run of unclosed blocks is one malformed block."""
        opening, closing = self.open_tag, self.close_tag
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[MalformedCall] = []
        pos, start = 0, text.find(opening)
        end = text.find(closing)  # the first close tag at or after the current block's body, -1 when none is left
        while start != -1:
            content.append(text[pos:start])
            body_start = start + len(opening)
            if end != -1 and end < body_start:
                end = text.find(closing, body_start)
            reopened = text.find(opening, body_start)
            if end == -1 or -1 < reopened < end:
                # unclosed: everything up to the open tag that `end` closes (or the reply's end) is one block
                stop = len(text) if end == -1 else text.rfind(opening, reopened, end)
                errors.append(MalformedCall(text[start:stop], f"{opening} without a closing {closing}"))
                pos, start = stop, (-1 if end == -1 else stop)
                continue
            call = self._read(text[body_start:end])
            (calls if isinstance(call, ToolCall) else errors).append(call)
            pos, start = end + len(closing), reopened
        content.append(text[pos:])
        return ParsedReply("".join(content).strip(), calls, errors)

    def _read(self, body: str) -> ToolCall | MalformedCall:
        raw = f"{self.open_tag}{body}{self.close_tag}"
        try:
            value = bounded_json.loads(body)
        except bounded_json.JsonRefused as e:
            return MalformedCall(raw, f"the text inside {self.open_tag} {e}")
        if not isinstance(value, dict):
            return MalformedCall(
                raw, f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {body.strip()!r}'
            )
        name, arguments = value.get("name"), value.get("arguments", {})
        if not isinstance(name, str) or not name:
            return MalformedCall(raw, 'the call has no "name" (a non-empty string)')
        if not isinstance(arguments, dict):
            return MalformedCall(raw, f'"arguments" must be a JSON object, got {json.dumps(arguments)}')
        return ToolCall(name, arguments)

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        blocks = [
            f"{self.open_tag}\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}\n"
            f"{self.close_tag}"
            for c in calls
        ]
        return "\n".join([content, *blocks] if content else blocks)


def calls_in_reply(message: Message, parser: ToolParser) -> list[ToolCall | MalformedCall]:
    """Every call an assistant message makes: its OpenAI `tool_calls` (a server that parsed the reply returns
    them), then whatever call blocks the parser finds in its text (all of them when nothing parsed it before; a
    server leaves only the malformed ones there)."""
    calls: list[ToolCall | MalformedCall] = [ToolCall.from_openai(entry) for entry in message.get("tool_calls") or []]
    parsed = parser.parse(last_assistant_text([message]))
    return [*calls, *parsed.calls, *parsed.errors]


def format_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls in the OpenAI `tool_calls` shape (ids `call_<hex>`, arguments a JSON string), for API responses and
    for assistant messages the chat template renders."""
    return [call.to_openai() for call in calls]


_PARSERS: dict[str, ToolParser] = {}
_MODEL_TYPES: dict[str, str] = {}
_MARKERS: dict[str, str] = {}


def register_tool_parser(
    parser: ToolParser, *, model_types: Sequence[str] = (), template_markers: Sequence[str] = ()
) -> None:
    """Make `parser` known by its name, by the model types it serves, and by text its chat templates contain."""
    for registry, keys in ((_PARSERS, [parser.name]), (_MODEL_TYPES, model_types), (_MARKERS, template_markers)):
        for key in keys:
            taken = registry.get(key)
            taken_name = taken.name if isinstance(taken, ToolParser) else taken
            if taken is not None and taken_name != parser.name:
                raise ValueError(f"{key!r} already belongs to tool parser {taken_name!r}")
    _PARSERS[parser.name] = parser
    _MODEL_TYPES.update(dict.fromkeys(model_types, parser.name))
    _MARKERS.update(dict.fromkeys(template_markers, parser.name))


def parser_for(model_type_or_template: str) -> ToolParser:
    """The parser for a parser name (`hermes`), a model type (`qwen3`), or a chat template's text."""
    key = model_type_or_template
    name = key if key in _PARSERS else _MODEL_TYPES.get(key)
    if name is None and ("{%" in key or "{{" in key):
        name = next((n for marker, n in _MARKERS.items() if marker in key), None)
        if name is None:
            raise ValueError(
                f"the chat template renders no tool-call syntax a parser knows (markers: {sorted(_MARKERS)}); "
                "register one with tandem.envs.tool_parsers.register_tool_parser"
            )
    if name is None:
        raise ValueError(
            f"no tool parser for {key!r}: parsers {sorted(_PARSERS)}, model types {sorted(_MODEL_TYPES)}; "
            "register one with tandem.envs.tool_parsers.register_tool_parser"
        )
    return _PARSERS[name]


register_tool_parser(
    HermesParser(), model_types=("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"), template_markers=("<tool_call>",)
)
