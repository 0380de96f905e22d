"""OpenAI function tools on /v1/chat/completions: schemas checked, tools and earlier calls rendered by the chat
template, and a reply's Hermes `<tool_call>` blocks returned as `tool_calls` (whole and streamed).

A tiny random model writes no calls, so the reply path is tested on fixed texts through the functions the
server builds its choices with; the round trips check what the server renders and accepts."""

from __future__ import annotations

import json
import threading
from functools import partial

import httpx
import openai
import pytest

from tandem.envs.tool_parsers import HermesParser, parser_for
from tandem.inference import openai_api, tool_calls
from tandem.inference.tool_calls import ToolStream, checked_tools, template_message

HERMES = parser_for("hermes")

# Qwen's tool rendering, cut down: tools in a system turn, earlier calls as <tool_call> blocks.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool(name: str = "add", **function) -> dict:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    return {"type": "function", "function": {"name": name, "description": "a + b", "parameters": schema, **function}}


CONVERSATION = [
    {"role": "user", "content": "what is 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]


@pytest.fixture(scope="module")
def tools_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("qwen3"))
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.fixture
def client(make_engine, serve, tools_tokenizer):
    server = serve(make_engine(seq_len=1024), tokenizer=tools_tokenizer)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{"type": "retrieval"}], r"tools\[0\]: .*only function tools"),
        ([{"type": "function"}], r"tools\[0\]\.function: "),
        ([tool("has space")], r"tools\[0\]\.function\.name: 'has space' must match"),
        ([tool("x" * 65)], r"tools\[0\]\.function\.name: "),
        ([tool(parameters={"type": "string"})], r"tools\[0\]\.function\.parameters: must be a JSON schema object"),
        ([tool(parameters=[1])], r"tools\[0\]\.function\.parameters: "),
        ([tool(parameters={"type": "object", "properties": 3})], r"parameters\.properties: "),
        ([tool(description=3)], r"tools\[0\]\.function\.description: "),
        ([tool(), tool()], r"tools: two tools share a name: \['add'\]"),
    ],
)
def test_bad_tool_schemas_are_refused_by_field(tools, message):
    with pytest.raises(ValueError, match=message):
        checked_tools(tools, "auto")


def test_tool_choice_picks_what_is_rendered():
    add, mul = tool("add"), tool("mul")
    assert checked_tools([add, mul], None) == checked_tools([add, mul], "auto") == [add, mul]
    assert checked_tools([add, mul], "none") is None and checked_tools(None, "auto") is None
    assert checked_tools([add, mul], {"type": "function", "function": {"name": "mul"}}) == [mul]
    with pytest.raises(ValueError, match=r"tool_choice: 'sub' is not one of the request's tools: \['add', 'mul'\]"):
        checked_tools([add, mul], {"type": "function", "function": {"name": "sub"}})
    for choice in ("required", {"type": "retrieval"}):
        with pytest.raises(ValueError, match='tool_choice: expected "auto", "none"'):
            checked_tools([add], choice)


def test_assistant_call_arguments_reach_the_template_as_objects():
    rendered = template_message(CONVERSATION[1])
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 3}'  # the request's untouched
    broken = {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]}
    assert template_message(broken) == broken and template_message(CONVERSATION[0]) is CONVERSATION[0]


def test_a_reply_with_calls_becomes_tool_calls():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "mul", "arguments": {"a": 4}}\n</tool_call>'
    message, finish = openai_api.chat_reply(text, "stop", HERMES)
    assert finish == "tool_calls" and message["content"] == "Let me add."
    calls = message["tool_calls"]
    assert [c["type"] for c in calls] == ["function", "function"]
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 2, "b": 3}, {"a": 4}]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]

    only_calls, _ = openai_api.chat_reply(text[text.index("<tool_call>") :], "stop", HERMES)
    assert only_calls["content"] is None
    cut, finish = openai_api.chat_reply(text, "length", HERMES)  # a cut-off reply says so
    assert finish == "length" and len(cut["tool_calls"]) == 2
    assert openai_api.chat_reply("plain", "stop", HERMES) == ({"content": "plain", "tool_calls": None}, "stop")
    assert openai_api.chat_reply("plain", "stop", None) == ({"content": "plain"}, "stop")
    bad, finish = openai_api.chat_reply("hi <tool_call>{not json}</tool_call>", "stop", HERMES)
    assert bad == {"content": "hi\n<tool_call>{not json}</tool_call>", "tool_calls": None} and finish == "stop"


def test_a_streamed_reply_sends_content_until_a_call_then_the_calls_at_the_end():
    stream = ToolStream(HERMES)
    pieces = ["Sure", ", adding. <tool", "_ca", 'll>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', " done"]
    deltas = [stream.update(piece, None) for piece in pieces]
    assert [d[0] for d in deltas] == ["Sure", ", adding. ", "", "", ""]
    content, calls, finish = stream.update("", "stop")
    assert content == "done" and finish == "tool_calls"
    assert [(c["index"], c["function"]) for c in calls] == [(0, {"name": "add", "arguments": '{"a": 1}'})]

    plain = ToolStream(HERMES)
    assert plain.update("a <to", None) == ("a ", None, None)
    assert plain.update("y", "stop") == ("<toy", None, "stop")  # a held prefix that is no tag goes out


def test_tools_and_earlier_calls_are_rendered_and_accepted(client, tools_tokenizer):
    add = tool()
    extra = {"return_token_ids": True}
    chat = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, tools=[add], max_tokens=4, extra_body=extra
    )
    assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = tools_tokenizer.decode(chat.prompt_token_ids)
    assert json.dumps(add) in prompt
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n5<|im_end|>" in prompt
    silent = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, tools=[add], tool_choice="none", max_tokens=1, extra_body=extra
    )
    assert "<tools>" not in tools_tokenizer.decode(silent.prompt_token_ids)
    named = {"type": "function", "function": {"name": "add"}}
    forced = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, tools=[add], tool_choice=named, max_tokens=1
    )
    assert forced.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ('{"a": ' + "[" * 1000 + "]" * 1000 + "}", "nests arrays and objects 1001 deep, more than 64"),
        ('{"a": ' + "7" * 4301 + "}", "has a number of more than 1000 digits"),
    ],
    ids=["deep", "huge-integer"],
)
def test_hostile_call_arguments_in_the_history_are_a_400_and_the_server_carries_on(client, arguments, problem):
    history = [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [{**CONVERSATION[1]["tool_calls"][0]}]}]
    history[1]["tool_calls"][0] = {**history[1]["tool_calls"][0], "function": {"name": "add", "arguments": arguments}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=history, tools=[tool()], max_tokens=2, stream=stream)
        assert refused.value.status_code == 400
        assert f"messages[1].tool_calls[0].function.arguments: {problem}" in refused.value.message
    answered = client.chat.completions.create(model="tiny", messages=CONVERSATION, tools=[tool()], max_tokens=2)
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")


class HeldParser(HermesParser):
    """Hermes, except that parsing a reply waits until the test lets it go: the test sees where parsing runs
    without depending on how long it takes."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def parse(self, text):
        self.started.set()
        assert self.release.wait(60), "the test never released the parser"
        return super().parse(text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_is_parsed_off_the_event_loop(make_engine, serve, tools_tokenizer, monkeypatch, stream):
    held = HeldParser()
    monkeypatch.setattr(tool_calls, "reply_parser", lambda template: held)
    # a tiny random model writes no call: an empty open tag makes a stream hold the whole reply and parse it last
    monkeypatch.setattr(tool_calls, "ToolStream", partial(ToolStream, open_tag=""))
    server = serve(make_engine(seq_len=1024), tokenizer=tools_tokenizer)
    body = {"messages": CONVERSATION, "tools": [tool()], "max_tokens": 3, "stream": stream}
    result = {}
    chat = threading.Thread(
        target=lambda: result.update(reply=httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120))
    )
    chat.start()
    try:
        assert held.started.wait(60), "the reply never reached the parser"
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # while the parser is held
        assert chat.is_alive()
    finally:
        held.release.set()
        chat.join(120)
    assert result["reply"].status_code == 200
    assert ("[DONE]" in result["reply"].text) if stream else result["reply"].json()["choices"][0]["finish_reason"]


def test_tool_descriptions_count_toward_max_prompt_chars(make_engine, serve, tools_tokenizer):
    """100 tools with 20 KB descriptions each and a one-word question (100 tools of 100 KB took 34 s to refuse):
    the rendered prompt is over the limit, a 400 before the tokenizer runs, and the server serves on."""
    server = serve(make_engine(seq_len=1024), tokenizer=tools_tokenizer)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tools = [tool(f"t{i}", description="d" * 20_000) for i in range(100)]
    messages = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=r"max_prompt_chars = 32768 \(default 32 per token"):
            client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=2, stream=stream)
    answered = client.chat.completions.create(model="tiny", messages=messages, tools=[tool()], max_tokens=2)
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tools_are_a_400_streaming_or_not(client):
    messages = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.name: 'bad name' must match"):
            client.chat.completions.create(model="tiny", messages=messages, tools=[tool("bad name")], stream=stream)
        with pytest.raises(openai.BadRequestError, match="tool_choice: 'mul' is not one of the request's tools"):
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=[tool()],
                tool_choice={"type": "function", "function": {"name": "mul"}},
                stream=stream,
            )


def test_a_streamed_chat_with_tools_completes(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=CONVERSATION, tools=[tool()], max_tokens=6, stream=True, temperature=0.0
        )
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length", "tool_calls")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, tools=[tool()], max_tokens=6, temperature=0.0
    )
    assert streamed.strip() == (whole.choices[0].message.content or "").strip()
