"""Tools an environment offers the model: Python callables with JSON-schema signatures, run by a per-episode ToolBox.

A tool is a plain function (sync or async); its schema comes from its type hints and docstring, so a tool is
written once and the chat template, the validator and the OpenAI API all read the same signature. A `ToolBox`
runs one episode's calls: whatever goes wrong (a malformed call, an unknown tool, bad arguments, an exception,
a timeout, an exhausted budget) comes back as an error result the model can read and correct, counted in
`ToolBox.stats`, and never raised, so a misbehaving policy cannot crash a run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import secrets
import types
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.envs import bounded_json
from tandem.envs.base import Message

JsonSchema = dict[str, Any]

ToolErrorKind = Literal["malformed", "unknown_tool", "invalid_arguments", "tool", "exception", "timeout", "budget"]
"""Why a call failed: `malformed` (could not be parsed), `unknown_tool`, `invalid_arguments` (against the
schema), `tool` (the tool raised `ToolError`: a failure it reports on purpose, e.g. code that crashed in the
sandbox), `exception` (any other exception), `timeout`, `budget` (over the episode's `max_calls`)."""

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolError(Exception):
    """Raised by a tool to answer with an error: its message goes to the model as it is."""


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry: arguments as a JSON string."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}

    @classmethod
    def from_openai(cls, entry: Mapping[str, Any]) -> ToolCall | MalformedCall:
        """Read an OpenAI `tool_calls` entry (arguments a JSON string or an object); a bad one is a MalformedCall."""
        call_id = entry.get("id") or new_call_id()
        function = entry.get("function")
        if not isinstance(function, Mapping):
            return MalformedCall(json.dumps(entry, default=str), "the call has no 'function' object", call_id)
        name, arguments = function.get("name"), function.get("arguments", {})
        raw = json.dumps(function, default=str)
        if not isinstance(name, str) or not name:
            return MalformedCall(raw, "the call has no function name", call_id)
        if isinstance(arguments, str):
            try:
                arguments = bounded_json.loads(arguments) if arguments.strip() else {}
            except bounded_json.JsonRefused as e:
                return MalformedCall(raw, f"the arguments string {e}", call_id)
        if not isinstance(arguments, dict):
            return MalformedCall(raw, f"arguments must be a JSON object, got {type(arguments).__name__}", call_id)
        return cls(name, arguments, call_id)


@dataclass(frozen=True)
class MalformedCall:
    """A tool call that could not be parsed: the raw text and what was wrong with it."""

    text: str
    message: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ToolResult:
    """The answer to one call: its text, and for a failed call `is_error` and the ToolErrorKind."""

    content: str
    tool_call_id: str
    name: str
    is_error: bool = False
    error: ToolErrorKind | None = None


def tool_message(result: ToolResult) -> Message:
    """The `tool` chat message that answers a call."""
    return {"role": "tool", "content": result.content, "tool_call_id": result.tool_call_id, "name": result.name}


def truncate(text: str, max_chars: int, omitted: int = 0) -> str:
    """`text` cut to about `max_chars`, keeping its head and tail (a traceback's end matters most) around a marker
    that says how many characters were left out; `omitted` counts ones already dropped before."""
    if len(text) <= max_chars and not omitted:
        return text
    keep = max(max_chars, 0)
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2) :] if keep else ""
    dropped = len(text) - len(head) - len(tail) + omitted
    return f"{head}\n[... {dropped} characters truncated ...]\n{tail}"


# --- schemas from signatures -------------------------------------------------------------------------------


def type_schema(hint: Any) -> JsonSchema:
    """The JSON schema of a type hint: str/int/float/bool, list[X], dict[str, X], Literal[...], unions and
    Optional, Any. Anything else is a TypeError naming the hint."""
    if hint is Any:
        return {}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is type(None):
        return {"type": "null"}
    if hint in (list, tuple):
        return {"type": "array"}
    if hint is dict:
        return {"type": "object"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        kinds = {type(a) for a in args}
        if not kinds <= set(_JSON_TYPES):
            raise TypeError(f"Literal values must be str/int/float/bool, got {hint!r}")
        schema: JsonSchema = {"enum": list(args)}
        if len(kinds) == 1:
            schema = {"type": _JSON_TYPES[kinds.pop()], **schema}
        return schema
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [type_schema(a) for a in args]}
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return {"type": "array", "items": type_schema(args[0])}
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"dict keys must be str (JSON object keys), got {hint!r}")
        return {"type": "object", "additionalProperties": type_schema(args[1])}
    raise TypeError(f"no JSON schema for type {hint!r}; use str, int, float, bool, list, dict, Literal or Optional")


_GOOGLE_HEADER = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Examples?|Notes?|Attributes)\s*:$")
_GOOGLE_ARG = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_NUMPY_ARG = re.compile(r"^(\w+)\s*(?::.*)?$")
_ARG_SECTIONS = ("Args", "Arguments", "Parameters")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """The description (the first paragraph, on one line) and per-parameter descriptions from a Google-style
    `Args:` section or a numpy-style `Parameters` section (a title underlined with dashes)."""
    lines = [line.rstrip() for line in inspect.cleandoc(doc or "").splitlines()]
    summary = []
    for i, line in enumerate(lines):
        if not line.strip() or _is_header(lines, i):
            break
        summary.append(line.strip())
    params: dict[str, str] = {}
    i = 0
    while i < len(lines):
        header = _is_header(lines, i)
        i += 1
        if header is None or header[0] not in _ARG_SECTIONS:
            continue
        numpy, base = header[1], len(lines[i - 1]) - len(lines[i - 1].lstrip())
        i += numpy  # the underline
        entry_indent, current = None, None
        while i < len(lines) and _is_header(lines, i) is None:
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= base and not numpy:
                break  # dedented out of a Google section
            if line.strip():
                if entry_indent is None:
                    entry_indent = indent
                match = (_NUMPY_ARG if numpy else _GOOGLE_ARG).match(line.strip())
                if indent == entry_indent and match:
                    current = match.group(1)
                    params[current] = "" if numpy else match.group(2)
                elif current is not None:
                    params[current] = f"{params[current]} {line.strip()}".strip()
            i += 1
    return " ".join(summary), params


def _is_header(lines: list[str], i: int) -> tuple[str, bool] | None:
    """(section title, numpy style) if line `i` starts a section: `Args:` or a title over a dashed underline."""
    text = lines[i].strip()
    if i + 1 < len(lines) and text and re.fullmatch(r"-{3,}", lines[i + 1].strip()):
        return text, True
    match = _GOOGLE_HEADER.match(text)
    return (match.group(1), False) if match else None


def signature_schema(fn: Callable[..., Any], descriptions: Mapping[str, str] | None = None) -> JsonSchema:
    """The `parameters` object schema of `fn`: one property per parameter (annotated), the ones without a
    default required; a JSON-encodable default is shown to the model."""
    hints = typing.get_type_hints(fn)
    properties: dict[str, JsonSchema] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {fn.__name__}: parameter {param.name!r} must be a named (keyword) parameter")
        if param.name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {param.name!r} needs a type annotation")
        schema = type_schema(hints[param.name])
        if descriptions and descriptions.get(param.name):
            schema = {**schema, "description": descriptions[param.name]}
        if param.default is param.empty:
            required.append(param.name)
        elif _encodable(param.default):
            schema = {**schema, "default": param.default}
        properties[param.name] = schema
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# --- validation --------------------------------------------------------------------------------------------


def validate(value: Any, schema: JsonSchema, path: str = "arguments") -> tuple[Any, list[str]]:
    """Check `value` against the schema subset `type_schema` writes; return it (integral floats where an
    integer is expected become ints) and the errors, each naming where it is."""
    if "anyOf" in schema:
        tried = [validate(value, option, path) for option in schema["anyOf"]]
        if valid := [converted for converted, errors in tried if not errors]:
            return valid[0], []
        same_type = [
            errors for option, (_, errors) in zip(schema["anyOf"], tried, strict=True) if _type_matches(value, option)
        ]
        if len(same_type) == 1:  # e.g. a list[int] | None given a list: what is wrong inside the list
            return value, same_type[0]
        return value, [f"{path}: {_show(value)} matches none of {_describe(schema)}"]
    if "enum" in schema and value not in schema["enum"]:
        return value, [f"{path}: {_show(value)} is not one of {schema['enum']}"]
    kind = schema.get("type")
    if kind is None:
        return value, []
    ok, value = _check_type(value, kind)
    if not ok:
        return value, [f"{path}: expected {kind}, got {_show(value)}"]
    errors: list[str] = []
    if kind == "array" and "items" in schema:
        items = []
        for i, item in enumerate(value):
            item, item_errors = validate(item, schema["items"], f"{path}[{i}]")
            items.append(item)
            errors += item_errors
        value = items
    elif kind == "object":
        value, errors = _validate_object(value, schema, path)
    return value, errors


def _type_matches(value: Any, schema: JsonSchema) -> bool:
    return "type" in schema and _check_type(value, schema["type"])[0]


def _check_type(value: Any, kind: str) -> tuple[bool, Any]:
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return True, int(value)
    if isinstance(value, bool):
        return kind == "boolean", value
    expected = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
    expected |= {"array": list, "object": dict}
    return isinstance(value, expected[kind]), value


def _validate_object(value: dict[str, Any], schema: JsonSchema, path: str) -> tuple[dict[str, Any], list[str]]:
    properties, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
    errors = [f"{path}: missing required argument {name!r}" for name in schema.get("required", ()) if name not in value]
    out = {}
    for key, item in value.items():
        sub = properties.get(key, extra if isinstance(extra, dict) else None)
        if sub is None and key not in properties and extra is False:
            errors.append(f"{path}: unexpected argument {key!r} (takes {sorted(properties) or 'no arguments'})")
            continue
        out[key], item_errors = validate(item, sub or {}, f"{path}.{key}")
        errors += item_errors
    return out, errors


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(schema: JsonSchema) -> str:
    return " | ".join(str(option.get("type", option.get("enum", "any"))) for option in schema["anyOf"])


# --- tools and the toolbox ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with its OpenAI function schema."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: JsonSchema
    timeout_s: float | None = None
    """Seconds one call may take; None leaves it to the ToolBox's `timeout_s`."""

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
    ) -> Tool:
        """Build the schema from `fn`'s type hints and docstring (first paragraph: the description)."""
        summary, params = parse_docstring(fn.__doc__)
        return cls(fn, name or fn.__name__, description or summary, signature_schema(fn, params), timeout_s)

    @property
    def is_async(self) -> bool:
        call = type(self.fn).__call__ if not inspect.isroutine(self.fn) else None  # an object with async __call__
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(call)

    def to_openai(self) -> dict[str, Any]:
        """`{"type": "function", "function": {...}}`, what `apply_chat_template(tools=...)` and the OpenAI API take."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Make a Tool of a function: `@tool` or `@tool(name=..., timeout_s=...)`."""
    if fn is None:
        return lambda f: Tool.from_function(f, name=name, description=description, timeout_s=timeout_s)
    return Tool.from_function(fn, name=name, description=description, timeout_s=timeout_s)


@dataclass
class ToolStats:
    """One episode's calls: how many were made and how many failed, by ToolErrorKind."""

    calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def as_metrics(self) -> dict[str, float]:
        """Flat numbers for episode metrics: `tool_calls`, `tool_errors` and `tool_errors/<kind>`."""
        metrics = {"tool_calls": float(self.calls), "tool_errors": float(sum(self.errors.values()))}
        return metrics | {f"tool_errors/{kind}": float(n) for kind, n in sorted(self.errors.items())}


class ToolBox:
    """The tools of one episode, with its call budget; `execute` answers every call, failed or not."""

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any]],
        *,
        max_calls: int | None = 16,
        timeout_s: float | None = 30.0,
        max_chars: int = 8000,
    ) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            t = t if isinstance(t, Tool) else Tool.from_function(t)
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        if max_calls is not None and max_calls < 0:
            raise ValueError(f"max_calls must be >= 0 or None, got {max_calls}")
        self.max_calls, self.timeout_s, self.max_chars = max_calls, timeout_s, max_chars
        self.stats = ToolStats()

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool in OpenAI form, for the chat template's `tools=`."""
        return [t.to_openai() for t in self.tools.values()]

    async def execute(self, call: ToolCall | MalformedCall | Mapping[str, Any]) -> ToolResult:
        """Run one call (a ToolCall, a MalformedCall from a parser, or an OpenAI `tool_calls` entry)."""
        if isinstance(call, Mapping):
            call = ToolCall.from_openai(call)
        self.stats.calls += 1
        if isinstance(call, MalformedCall):
            return self._error(call.id, "", "malformed", f"Error: malformed tool call: {call.message}.")
        if self.max_calls is not None and self.stats.calls > self.max_calls:
            text = f"Error: tool budget exhausted (at most {self.max_calls} tool calls per episode); answer directly."
            return self._error(call.id, call.name, "budget", text)
        tool_ = self.tools.get(call.name)
        if tool_ is None:
            known = ", ".join(self.tools) or "none"
            return self._error(
                call.id, call.name, "unknown_tool", f"Error: unknown tool {call.name!r}; tools: {known}."
            )
        arguments, errors = validate(call.arguments, tool_.parameters)
        if errors:
            text = f"Error: invalid arguments for {call.name}: " + "; ".join(errors) + "."
            return self._error(call.id, call.name, "invalid_arguments", text)
        return await self._run(tool_, call.id, arguments)

    async def _run(self, tool_: Tool, call_id: str, arguments: dict[str, Any]) -> ToolResult:
        timeout = tool_.timeout_s if tool_.timeout_s is not None else self.timeout_s
        try:
            if tool_.is_async:
                value = await asyncio.wait_for(tool_.fn(**arguments), timeout)
            else:  # a sync tool cannot be stopped: the wait times out, its thread runs on to its end
                value = await asyncio.wait_for(asyncio.to_thread(tool_.fn, **arguments), timeout)
        except TimeoutError:
            return self._error(call_id, tool_.name, "timeout", f"Error: {tool_.name} timed out after {timeout:g} s.")
        except ToolError as e:
            return self._error(call_id, tool_.name, "tool", truncate(str(e), self.max_chars))
        except Exception as e:
            text = truncate(f"Error: {tool_.name} raised {type(e).__name__}: {e}", self.max_chars)
            return self._error(call_id, tool_.name, "exception", text)
        return ToolResult(truncate(to_text(value), self.max_chars), call_id, tool_.name)

    def _error(self, call_id: str, name: str, kind: ToolErrorKind, text: str) -> ToolResult:
        self.stats.errors[kind] += 1
        return ToolResult(text, call_id, name, is_error=True, error=kind)


def to_text(value: Any) -> str:
    """A tool's return value as the model reads it: a str as it is, anything else as JSON (what JSON cannot
    encode, through str())."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)
