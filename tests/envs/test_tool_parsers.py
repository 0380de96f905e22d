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


HUGE_INTEGER = "7" * 4301  # past Python's int-str conversion limit: json.loads raises ValueError
DEEP = "[" * 1000 + "]" * 1000  # past the interpreter's stack: json.loads raises RecursionError


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (f'{{"n": {HUGE_INTEGER}}}', "has a number of more than 1000 digits"),
        (f'{{"n": -{HUGE_INTEGER}.5e{HUGE_INTEGER}}}', "has a number of more than 1000 digits"),
        (f'{{"n": {DEEP}}}', "nests arrays and objects 1002 deep, more than 64"),  # the call's two objects too
        ('{"n": ' * 1000 + "1" + "}" * 1000, "nests arrays and objects 1001 deep, more than 64"),
        ("[" * 100_000, "nests arrays and objects 100001 deep, more than 64"),
    ],
    ids=["huge-integer", "huge-float", "deep-arrays", "deep-objects", "unclosed-arrays"],
)
def test_hostile_json_in_a_block_is_a_malformed_call(arguments, message):
    reply = hermes.parse("x " + block(f'{{"name": "add", "arguments": {arguments}}}') + block('{"name": "now"}'))
    (error,) = reply.errors
    assert error.message == f"the text inside <tool_call> {message}"
    assert [c.name for c in reply.calls] == ["now"] and reply.content == "x"


def test_brackets_and_digits_inside_json_strings_are_text():
    code = "print(" + "[" * 1000 + HUGE_INTEGER + "]" * 1000 + ")"
    (call,) = hermes.parse(block(json.dumps({"name": "python", "arguments": {"code": code}}))).calls
    assert call.arguments == {"code": code}


class CountedText(str):
    """A reply that counts the characters its `find`/`rfind` searches pass over: the parser's work."""

    def __new__(cls, text: str):
        self = super().__new__(cls, text)
        self.scanned = 0
        return self

    def find(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        found = str.find(self, sub, start, end)
        self.scanned += (end if found == -1 else found + len(sub)) - start
        return found

    def rfind(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        found = str.rfind(self, sub, start, end)
        self.scanned += end - (start if found == -1 else found)
        return found


@pytest.mark.parametrize(
    "pieces",
    [
        ["<tool_call>"] * 80_000,  # the reply: 80,000 unclosed tags
        ["<tool_call>{", "</tool_call>", " text "] * 20_000,
        [*["<tool_call>{"] * 20_000, block('{"name": "now"}')] * 4 + ["</tool_call>"] * 20_000,
    ],
    ids=["unclosed", "closed-empty", "runs-then-stray-closes"],
)
def test_parsing_is_linear_in_the_reply(pieces):
    text = CountedText("".join(pieces))
    reply = hermes.parse(text)
    assert text.scanned <= 4 * len(text)  # quadratic: each unclosed tag searched the rest of the reply
    blocks = text.count("<tool_call>")
    assert len(reply.calls) + len(reply.errors) <= min(blocks, text.count("</tool_call>") + 1)
    assert all(e.message.startswith(("<tool_call> without", "the text inside")) for e in reply.errors)


def test_a_run_of_unclosed_blocks_is_one_malformed_block():
    reply = hermes.parse("a <tool_call>x<tool_call>y " + block('{"name": "now"}') + " b <tool_call>z<tool_call>")
    assert [e.text for e in reply.errors] == ["<tool_call>x<tool_call>y ", "<tool_call>z<tool_call>"]
    assert [c.name for c in reply.calls] == ["now"] and reply.content == "a  b"


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
