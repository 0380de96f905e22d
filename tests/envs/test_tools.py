"""Tools: schemas from signatures and docstrings, argument validation, and a ToolBox that answers every call."""

from __future__ import annotations

import asyncio
import threading
from pathlib import PurePosixPath
from typing import Any, Literal, Optional

import pytest

from tandem.envs.tools import (
    MalformedCall,
    Tool,
    ToolBox,
    ToolCall,
    ToolError,
    parse_docstring,
    tool,
    tool_message,
    truncate,
    validate,
)


def _text(x: str) -> None: ...
def _numbers(n: int, x: float = 0.5, flag: bool = False) -> None: ...
def _lists(items: list[int], tags: list[str] | None = None, grid: list[list[float]] = []) -> None: ...  # noqa: B006
def _dicts(config: dict[str, int], raw: dict = {}) -> None: ...  # noqa: B006
def _choices(mode: Literal["add", "mul"], level: Literal[1, 2, 3] = 1) -> None: ...
def _optional(a: Optional[int], b: int | str, c: Any = None) -> None: ...  # noqa: UP045
def _tuple(xs: tuple[int, ...]) -> None: ...


@pytest.mark.parametrize(
    ("fn", "properties", "required"),
    [
        (_text, {"x": {"type": "string"}}, ["x"]),
        (
            _numbers,
            {
                "n": {"type": "integer"},
                "x": {"type": "number", "default": 0.5},
                "flag": {"type": "boolean", "default": False},
            },
            ["n"],
        ),
        (
            _lists,
            {
                "items": {"type": "array", "items": {"type": "integer"}},
                "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}], "default": None},
                "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}, "default": []},
            },
            ["items"],
        ),
        (
            _dicts,
            {
                "config": {"type": "object", "additionalProperties": {"type": "integer"}},
                "raw": {"type": "object", "default": {}},
            },
            ["config"],
        ),
        (
            _choices,
            {
                "mode": {"type": "string", "enum": ["add", "mul"]},
                "level": {"type": "integer", "enum": [1, 2, 3], "default": 1},
            },
            ["mode"],
        ),
        (
            _optional,
            {
                "a": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "b": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "c": {"default": None},
            },
            ["a", "b"],
        ),
        (_tuple, {"xs": {"type": "array", "items": {"type": "integer"}}}, ["xs"]),
    ],
)
def test_schema_from_signature(fn, properties, required):
    schema = Tool.from_function(fn).parameters
    assert schema == {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def test_openai_form_with_google_docstring():
    @tool
    def lookup(city: str, days: int = 1) -> str:
        """Look up the weather forecast
        for a city.

        Longer notes the model does not need.

        Args:
            city: The city's name,
                in English.
            days (int): How many days ahead.

        Returns:
            The forecast.
        """
        return ""

    assert lookup.to_openai() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name, in English."},
                    "days": {"type": "integer", "description": "How many days ahead.", "default": 1},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }


def test_numpy_docstring():
    doc = """Add numbers.

    Parameters
    ----------
    a : int
        The first
        number.
    b
        The second.

    Returns
    -------
    int
        Not a parameter.
    """
    assert parse_docstring(doc) == ("Add numbers.", {"a": "The first number.", "b": "The second."})


def test_decorator_options_and_no_docstring():
    @tool(name="calc", description="Evaluate.", timeout_s=2.0)
    def f(expression: str) -> str:
        return expression

    assert (f.name, f.description, f.timeout_s) == ("calc", "Evaluate.", 2.0)
    assert Tool.from_function(_text).description == ""


@pytest.mark.parametrize(
    ("signature", "message"),
    [
        ("def f(x): ...", "needs a type annotation"),
        ("def f(*xs: int): ...", "must be a named"),
        ("def f(x: set[int]): ...", "no JSON schema"),
        ("def f(x: dict[int, str]): ...", "keys must be str"),
        ("def f(x: Literal[None]): ...", "Literal values"),
    ],
)
def test_unsupported_signatures_fail_at_definition(signature, message):
    namespace: dict[str, Any] = {"Literal": Literal}
    exec(signature, namespace)
    with pytest.raises(TypeError, match=message):
        Tool.from_function(namespace["f"])


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({}, "missing required argument 'n'"),
        ({"n": "3"}, 'arguments.n: expected integer, got "3"'),
        ({"n": True}, "arguments.n: expected integer, got true"),
        ({"n": 2.5}, "expected integer, got 2.5"),
        ({"n": 1, "mode": "div"}, "arguments.mode: \"div\" is not one of ['add', 'mul']"),
        ({"n": 1, "items": [1, "x"]}, "arguments.items[1]: expected integer"),
        ({"n": 1, "extra": 0}, "unexpected argument 'extra'"),
        ({"n": 1, "opt": []}, "arguments.opt: [] matches none of integer | null"),
        ({"n": 1, "weights": {"a": "heavy"}}, "arguments.weights.a: expected number"),
    ],
)
def test_validation_errors_name_the_argument(arguments, error):
    def f(
        n: int,
        mode: Literal["add", "mul"] = "add",
        items: list[int] | None = None,
        opt: int | None = None,
        weights: dict[str, float] | None = None,
    ) -> None: ...

    _, errors = validate(arguments, Tool.from_function(f).parameters)
    assert any(error in e for e in errors), errors


def test_validation_accepts_and_converts():
    def f(n: int, x: float, items: list[int], opt: int | None = None) -> None: ...

    value, errors = validate({"n": 3.0, "x": 2, "items": [1.0], "opt": None}, Tool.from_function(f).parameters)
    assert errors == []
    assert value == {"n": 3, "x": 2, "items": [1], "opt": None}
    assert isinstance(value["n"], int) and isinstance(value["items"][0], int)


def run(coro):
    return asyncio.run(coro)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def greet(name: str) -> str:
    await asyncio.sleep(0)
    return f"hello {name}"


def test_sync_and_async_tools_and_serialisation():
    def info(key: str) -> dict:
        return {"key": key, "values": [1, 2], "path": PurePosixPath("/a/b")}

    box = ToolBox([add, greet, info])

    async def calls():
        return [
            await box.execute(ToolCall("add", {"a": 2, "b": 3}, "call_1")),
            await box.execute(ToolCall("greet", {"name": "Ada"})),
            await box.execute(ToolCall("info", {"key": "k"})),
        ]

    r_add, r_greet, r_info = run(calls())
    assert (r_add.content, r_add.tool_call_id, r_add.name, r_add.is_error) == ("5", "call_1", "add", False)
    assert r_greet.content == "hello Ada"
    assert r_info.content == '{"key": "k", "values": [1, 2], "path": "/a/b"}'
    assert box.stats.calls == 3 and not box.stats.errors
    assert tool_message(r_add) == {"role": "tool", "content": "5", "tool_call_id": "call_1", "name": "add"}
    assert [s["function"]["name"] for s in box.schemas()] == ["add", "greet", "info"]


def test_openai_tool_call_entries():
    box = ToolBox([add])
    good = {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    assert run(box.execute(good)).content == "3"
    bad_json = {"id": "call_y", "function": {"name": "add", "arguments": "{a: 1"}}
    result = run(box.execute(bad_json))
    assert result.is_error and result.error == "malformed" and "not valid JSON" in result.content
    assert result.tool_call_id == "call_y"
    for arguments, problem in (
        ("[" * 5000, "nests arrays and objects 5000 deep"),
        ("9" * 4301, "has a number of more than 1000 digits"),
    ):
        hostile = run(box.execute({"id": "call_h", "function": {"name": "add", "arguments": arguments}}))
        assert hostile.error == "malformed" and f"the arguments string {problem}" in hostile.content
    no_function = run(box.execute({"id": "call_z"}))
    assert no_function.error == "malformed" and "no 'function'" in no_function.content


def test_errors_become_results_and_are_counted():
    def broken(x: int) -> int:
        raise KeyError("missing")

    def refuses(x: int) -> int:
        raise ToolError("Error: x must be positive")

    box = ToolBox([add, broken, refuses], max_calls=None)

    async def calls():
        return [
            await box.execute(MalformedCall("<tool_call>{", "unclosed")),
            await box.execute(ToolCall("subtract", {"a": 1})),
            await box.execute(ToolCall("add", {"a": 1})),
            await box.execute(ToolCall("broken", {"x": 1})),
            await box.execute(ToolCall("refuses", {"x": -1})),
        ]

    results = run(calls())
    assert [r.error for r in results] == ["malformed", "unknown_tool", "invalid_arguments", "exception", "tool"]
    assert all(r.is_error for r in results)
    assert "unclosed" in results[0].content
    assert "unknown tool 'subtract'; tools: add, broken, refuses" in results[1].content
    assert "missing required argument 'b'" in results[2].content
    assert results[3].content == "Error: broken raised KeyError: 'missing'"
    assert results[4].content == "Error: x must be positive"
    assert box.stats.as_metrics() == {
        "tool_calls": 5.0,
        "tool_errors": 5.0,
        "tool_errors/exception": 1.0,
        "tool_errors/invalid_arguments": 1.0,
        "tool_errors/malformed": 1.0,
        "tool_errors/tool": 1.0,
        "tool_errors/unknown_tool": 1.0,
    }


def test_timeouts_for_async_and_sync_tools():
    release = threading.Event()

    async def slow_async(x: int) -> int:
        await asyncio.sleep(3600)
        return x

    def slow_sync(x: int) -> int:
        release.wait()
        return x

    box = ToolBox([slow_async, Tool.from_function(slow_sync, timeout_s=0.05)], timeout_s=0.05)

    async def calls():
        try:
            return await box.execute(ToolCall("slow_async", {"x": 1})), await box.execute(
                ToolCall("slow_sync", {"x": 1})
            )
        finally:
            release.set()  # the timed-out thread runs on; asyncio.run waits for it when it closes the loop

    first, second = run(calls())
    assert (first.error, first.content) == ("timeout", "Error: slow_async timed out after 0.05 s.")
    assert second.error == "timeout"
    assert box.stats.errors["timeout"] == 2


def test_budget():
    box = ToolBox([add], max_calls=2)

    async def calls():
        return [await box.execute(ToolCall("add", {"a": i, "b": 0})) for i in range(4)]

    results = run(calls())
    assert [r.content for r in results[:2]] == ["0", "1"]
    assert [r.error for r in results[2:]] == ["budget", "budget"]
    assert "at most 2 tool calls per episode" in results[2].content
    assert box.stats.calls == 4 and box.stats.errors == {"budget": 2}


def test_results_are_truncated():
    def long(n: int) -> str:
        return "a" * n + "END"

    box = ToolBox([long], max_chars=100)
    result = run(box.execute(ToolCall("long", {"n": 10_000})))
    assert len(result.content) < 200 and result.content.endswith("END")
    assert "[... 9903 characters truncated ...]" in result.content
    assert truncate("short", 100) == "short"


def test_toolbox_rejects_duplicate_names():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolBox([add, Tool.from_function(greet, name="add")])
