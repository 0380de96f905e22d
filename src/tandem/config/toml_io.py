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


def read_toml(path: str | Path) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    """Parse a TOML file; return its table and the line number of every key it assigns."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"malformed TOML in {path}: {error}") from None
    return data, key_lines(text)


def parse_toml_value(text: str) -> Any:
    """Parse one TOML value written on the command line (`[1, 2]`, `{a = 1}`, `"x"`)."""
    return tomllib.loads(f"v = {text}")["v"]


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
