"""Reading and writing TOML config files, with errors that name the file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from tandem.config.errors import ConfigError

KeyPath = tuple[str | int, ...]

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_ASSIGN = re.compile(r"^\s*([A-Za-z0-9_\-\"'. ]+?)\s*=")


MAX_DEPTH = 32
"""Deepest nesting of tables and arrays a config may have. No config model comes near it; the parser, the
merge and validation recurse once per level, so a deeper file would end in a RecursionError."""


def read_toml(path: str | Path) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    """Parse a TOML file; return its table and the line number of every key it assigns."""
    path = Path(path)
    text = _read_text(path)
    try:
        data = _parse(text)
    except ValueError as error:
        raise ConfigError(f"malformed TOML in {path}: {error}") from None
    return data, key_lines(text)


def _read_text(path: Path) -> str:
    """The file's text, or a ConfigError saying why it cannot be read as a config file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a TOML file")
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path} is not UTF-8 text (invalid byte at offset {error.start})") from None


def _parse(text: str) -> dict[str, Any]:
    """tomllib's table for `text`, refusing nesting deeper than MAX_DEPTH (raises ValueError)."""
    too_deep = ValueError(f"tables and arrays nest deeper than {MAX_DEPTH} levels")
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise too_deep from None
    if _depth(data) > MAX_DEPTH:
        raise too_deep
    return data


def _depth(value: Any) -> int:
    """Nesting depth of parsed tables and arrays, walked without recursion (dotted keys and `[a.b.c]` headers
    nest without the parser recursing, so a parsed table can be deeper than the parser could go)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_toml_value(text: str) -> Any:
    """Parse one TOML value written on the command line (`[1, 2]`, `{a = 1}`, `"x"`); raises ValueError."""
    return _parse(f"v = {text}")["v"]


def _split_key(key: str) -> list[str]:
    return [part.strip().strip("\"'") for part in key.split(".")]


def key_lines(text: str) -> dict[KeyPath, int]:
    """Best-effort map from key path to 1-based line number, for error messages."""
    lines: dict[KeyPath, int] = {}
    prefix: KeyPath = ()
    array_counts: dict[KeyPath, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("#"):
            continue
        header = _HEADER.match(line)
        if header:
            table = tuple(_split_key(header.group(2)))
            if header.group(1) == "[[":
                index = array_counts.get(table, -1) + 1
                array_counts[table] = index
                prefix = (*table, index)
            else:
                prefix = table
            lines.setdefault(prefix, number)
            continue
        assign = _ASSIGN.match(line)
        if assign:
            lines.setdefault((*prefix, *_split_key(assign.group(1))), number)
    return lines


def dump_toml(data: dict[str, Any]) -> str:
    """Serialise a (JSON-mode) config dump; `None` values are left out since TOML has no null."""
    return tomli_w.dumps(_drop_none(data))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
