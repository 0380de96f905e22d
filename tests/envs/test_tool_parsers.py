"""Tool-call parsing: the hermes format on well-formed and malformed replies, its inverse, and parser lookup."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tandem.envs import tool_parsers
from tandem.envs.tool_parsers import (
    HermesParser,
    ParsedReply,
    ToolParser,
    format_tool_calls,
    parser_for,
    register_tool_parser,
)
from tandem.envs.tools import ToolBox, ToolCall, tool_message

hermes = HermesParser()


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just an answer: 42.", "Just an answer: 42.", []),
        (block('{"name": "add", "arguments": {"a": 1, "b": 2}}'), "", [("add", {"a": 1, "b": 2})]),
        (
            "Let me compute.\n" + block('{"name": "add", "arguments": {"a": 1, "b": 2}}'),
            "Let me compute.",
            [("add", {"a": 1, "b": 2})],
        ),
        (
            "Two calls:\n"
            + block('{"name": "add", "arguments": {"a": 1, "b": 2}}')
            + "\n"
            + block('{"name": "python", "arguments": {"code": "print(1)"}}')
            + "\nand done.",
            "Two calls:\n\n\nand done.",
            [("add", {"a": 1, "b": 2}), ("python", {"code": "print(1)"})],
        ),
        (
            block('{"name": "search", "arguments": {"q": {"all": ["a", {"b": [1, 2]}]}, "s": "}</x>{"}}'),
            "",
            [("search", {"q": {"all": ["a", {"b": [1, 2]}]}, "s": "}</x>{"})],
        ),
        ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),  # no arguments: a call without any
        (
            "<think>need a tool</think>" + block('{"name": "now", "arguments": {}}'),
            "<think>need a tool</think>",
            [("now", {})],
        ),
    ],
)
def test_hermes_parses_well_formed_replies(text, content, calls):
    reply = hermes.parse(text)
    assert reply.content == content
    assert [(c.name, c.arguments) for c in reply.calls] == calls
    assert reply.errors == []
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in reply.calls)
    assert len({c.id for c in reply.calls}) == len(calls)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (block('{"name": "add", "arguments": {"a": 1,}}'), "is not valid JSON"),
        (block("add(1, 2)"), "is not valid JSON"),
        (block('{"arguments": {"a": 1}}'), 'no "name"'),
        (block('{"name": "", "arguments": {}}'), 'no "name"'),
        (block('{"name": 7, "arguments": {}}'), 'no "name"'),
        (block('{"name": "add", "arguments": [1, 2]}'), '"arguments" must be a JSON object, got [1, 2]'),
        (block('{"name": "add", "arguments": "{\\"a\\": 1}"}'), '"arguments" must be a JSON object'),
        (block('[{"name": "add", "arguments": {}}]'), "expected a JSON object"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "without a closing </tool_call>"),
    ],
)
def test_hermes_malformed_blocks_are_errors(text, message):
    reply = hermes.parse("Before. " + text)
    assert reply.calls == []
    (error,) = reply.errors
    assert message in error.message
    assert error.text.startswith("<tool_call>")
    assert reply.content == "Before."


def test_hermes_keeps_good_calls_around_a_bad_one():
    text = (
        block('{"name": "a", "arguments": {}}')
        + "<tool_call>{broken"  # reopened before it closes: this block is unclosed
        + block('{"name": "b", "arguments": {"x": 1}}')
        + " tail </tool_call> stray"
    )
    reply = hermes.parse(text)
    assert [c.name for c in reply.calls] == ["a", "b"]
    assert [e.text for e in reply.errors] == ["<tool_call>{broken"]
    assert reply.content == "tail </tool_call> stray"


def test_render_parse_round_trip():
    calls = [ToolCall("add", {"a": 1, "b": 2}), ToolCall("python", {"code": 'print("é\\n")', "opts": {"x": [1, None]}})]
    text = hermes.render(calls, content="I will use tools.")
    assert text.startswith(
        'I will use tools.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    reply = hermes.parse(text)
    assert reply.content == "I will use tools."
    assert [(c.name, c.arguments) for c in reply.calls] == [(c.name, c.arguments) for c in calls]
    assert hermes.parse(hermes.render(calls)).content == ""


def test_format_tool_calls_is_the_openai_shape_and_reads_back():
    calls = [ToolCall("add", {"a": 1, "b": 2}), ToolCall("now", {})]
    formatted = format_tool_calls(calls)
    assert formatted[0] == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    assert all(isinstance(f["function"]["arguments"], str) for f in formatted)
    assert [ToolCall.from_openai(f) for f in formatted] == calls
    assert json.loads(json.dumps(formatted)) == formatted


def test_parsed_reply_runs_through_a_toolbox():
    def add(a: int, b: int) -> int:
        return a + b

    reply = hermes.parse(
        "Sure.\n" + block('{"name": "add", "arguments": {"a": 2, "b": 2}}') + block('{"name": "add", "arguments": 5}')
    )
    box = ToolBox([add])

    async def answer():
        return [tool_message(await box.execute(c)) for c in [*reply.calls, *reply.errors]]

    ok, bad = asyncio.run(answer())
    assert ok == {"role": "tool", "content": "4", "tool_call_id": reply.calls[0].id, "name": "add"}
    assert bad["content"].startswith('Error: malformed tool call: "arguments" must be a JSON object, got 5')
    assert box.stats.calls == 2 and box.stats.errors == {"malformed": 1}


QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- endif %}"
)


@pytest.mark.parametrize("key", ["hermes", "qwen2", "qwen3", "qwen3_moe", QWEN_LIKE_TEMPLATE])
def test_parser_for_qwen_family(key):
    assert parser_for(key).name == "hermes"


def test_parser_for_unknown_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no tool parser for 'gpt2'.*model types \[.*'qwen3'.*register_tool_parser"):
        parser_for("gpt2")
    with pytest.raises(ValueError, match="renders no tool-call syntax"):
        parser_for("{% for m in messages %}{{ m.content }}{% endfor %}")


class BracketParser(ToolParser):
    """A made-up family: `[[name {json arguments}]]`."""

    name = "bracket"

    def parse(self, text: str) -> ParsedReply:
        calls = [ToolCall(m[1], json.loads(m[2])) for m in re.finditer(r"\[\[(\w+) (\{.*?\})\]\]", text)]
        return ParsedReply(re.sub(r"\[\[.*?\]\]", "", text).strip(), calls)

    def render(self, calls, content=""):
        return content + "".join(f"[[{c.name} {json.dumps(c.arguments)}]]" for c in calls)


def test_register_a_parser(monkeypatch):
    for registry in ("_PARSERS", "_MODEL_TYPES", "_MARKERS"):
        monkeypatch.setattr(tool_parsers, registry, dict(getattr(tool_parsers, registry)))
    register_tool_parser(BracketParser(), model_types=("bracket_lm",), template_markers=("[[",))
    assert parser_for("bracket_lm").parse('hi [[add {"a": 1}]]').calls[0].arguments == {"a": 1}
    assert parser_for("{{ '[[' }}").name == "bracket"
    register_tool_parser(BracketParser(), model_types=("bracket_lm",))  # the same again is fine
    with pytest.raises(ValueError, match="'qwen3' already belongs to tool parser 'hermes'"):
        register_tool_parser(BracketParser(), model_types=("qwen3",))
