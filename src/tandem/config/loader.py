"""Resolve a command line into a validated config.

Precedence: model defaults < `@ file.toml` files (merged deeply, left to right)
< `--section @ file.toml` section files < `--dotted.kebab-key value` flags, in
the order they appear. Lists are replaced whole, never appended to. Every key
is checked against the model before merging, so an error can say which file
(and line) or which flag it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tandem.config.errors import ConfigError
from tandem.config.schema import (
    FieldKind,
    UnknownKey,
    annotation_name,
    field_kind,
    kebab,
    lookup,
    normalise_key,
    suggest,
)
from tandem.config.toml_io import KeyPath, parse_toml_value, read_toml

ConfigT = TypeVar("ConfigT", bound=BaseModel)


@dataclass
class Layers:
    """Sources merged so far: the raw table and where each key came from."""

    data: dict[str, Any] = field(default_factory=dict)
    origin: dict[KeyPath, str] = field(default_factory=dict)


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; any other value (lists included) replaces what was there."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(origin: dict[KeyPath, str], path: KeyPath, fallback: str) -> str:
    for end in range(len(path), 0, -1):
        if path[:end] in origin:
            return origin[path[:end]]
    return fallback


@dataclass
class _Source:
    """One file or flag being merged: its name, key lines, and the shared origin map."""

    name: str
    origin: dict[KeyPath, str]
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def where(self, raw_path: KeyPath) -> str:
        line = self.lines.get(raw_path)
        return f"{self.name}:{line}" if line else self.name


def _checked(
    model: type[BaseModel], data: dict[str, Any], source: _Source, raw_prefix: KeyPath = (), key_prefix: KeyPath = ()
) -> dict[str, Any]:
    """Normalise keys to snake_case, reject unknown ones, record where each key came from."""
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = normalise_key(raw_key)
        raw_path, key_path = (*raw_prefix, raw_key), (*key_prefix, key)
        where = source.where(raw_path)
        try:
            _, kind = lookup(model, [key])
        except UnknownKey as error:
            dotted = ".".join(kebab(str(part)) for part in key_path)
            raise ConfigError(
                f"unknown key `{dotted}`{suggest(key, error.valid, key_prefix, model)} in {where}"
            ) from None
        source.origin[key_path] = where
        value = _shorthand_to_table(kind, value)
        if kind.model is not None and isinstance(value, dict):
            value = _checked(kind.model, value, source, raw_path, key_path)
        elif kind.list_of_model is not None and isinstance(value, list):
            value = [
                _checked(kind.list_of_model, item, source, (*raw_path, i), (*key_path, i))
                if isinstance(item, dict)
                else item
                for i, item in enumerate(value)
            ]
        out[key] = value
    return out


def _shorthand_to_table(kind: FieldKind, value: Any) -> Any:
    """A section given as a scalar (`model = "dir"`) becomes the table its own validator makes of it,
    so a later `--model.dtype` merges into it instead of replacing it. Scalars the section does not
    accept are left for the parent's validators (a field-level shorthand) or the final error."""
    if kind.model is None or isinstance(value, dict):
        return value
    try:
        return kind.model.model_validate(value).model_dump(exclude_unset=True)
    except ValidationError:
        return value


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def add_file(layers: Layers, model: type[BaseModel], file: str, section: list[str] | None = None) -> None:
    """Merge a TOML file at the root, or under `section` for `--section @ file.toml`."""
    target, prefix = model, tuple(section or ())
    if prefix:
        flag = f"--{'.'.join(map(kebab, prefix))} @ {file}"
        try:
            _, kind = lookup(model, list(prefix))
        except UnknownKey as error:
            raise ConfigError(f"{error.describe()} (flag {flag})") from None
        if kind.model is None:
            raise ConfigError(f"`{flag}`: that key is not a section")
        target = kind.model
    data, lines = read_toml(file)
    checked = _checked(target, data, _Source(file, layers.origin, lines), (), prefix)
    layers.data = deep_merge(layers.data, _nest(list(prefix), checked))


def _flag_value(kind: FieldKind, flag: str, values: list[str]) -> Any:
    if not values:
        if kind.is_bool:
            return True
        if kind.model is not None and "enabled" in kind.model.model_fields:
            return {"enabled": True}
        raise ConfigError(f"flag {flag} needs a value ({annotation_name(kind.annotation)})")
    if kind.is_list:
        if len(values) == 1 and values[0].lstrip().startswith("["):
            return _toml_literal(flag, values[0])
        return values[0] if kind.or_scalar and len(values) == 1 else values
    if len(values) > 1:
        raise ConfigError(f"flag {flag} takes one value, got {len(values)}: {' '.join(values)}")
    if (kind.is_mapping or kind.model is not None) and values[0].lstrip().startswith("{"):
        return _toml_literal(flag, values[0])
    return values[0]


def _toml_literal(flag: str, text: str) -> Any:
    try:
        return parse_toml_value(text)
    except ValueError as error:
        shown = text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
        raise ConfigError(f"flag {flag}: cannot parse {shown!r} as a TOML value: {error}") from None


def add_flag(layers: Layers, model: type[BaseModel], flag: str, values: list[str]) -> None:
    """Merge one `--dotted.key value...` flag; `--no-x` sets the boolean `x` to false."""
    name, _, inline = flag[2:].partition("=")
    if inline:
        values = [inline, *values]
    path = [normalise_key(part) for part in name.split(".")]
    negated = False
    try:
        _, kind = lookup(model, path)
    except UnknownKey as error:
        for candidate in _negations(path):
            try:
                _, kind = lookup(model, candidate)
            except UnknownKey:
                continue
            path, negated = candidate, True
            break
        else:
            raise ConfigError(f"{error.describe()} (flag {flag})") from None
    if negated and kind.model is not None and "enabled" in kind.model.model_fields and not values:
        value: Any = {"enabled": False}
    elif negated:
        if not kind.is_bool or values:
            raise ConfigError(f"flag {flag}: `--no-` only applies to boolean keys, with no value")
        value = False
    else:
        value = _flag_value(kind, flag, values)
    value = _shorthand_to_table(kind, value)
    if kind.model is not None and isinstance(value, dict):
        value = _checked(kind.model, value, _Source(f"flag {flag}", layers.origin), (), tuple(path))
    if kind.is_mapping and isinstance(value, str) and len(path) > _depth_of_mapping(model, path):
        value = _literal_or_string(value)  # keys inside a free-form table have no declared type
    layers.origin[tuple(path)] = f"flag {flag}"
    layers.data = deep_merge(layers.data, _nest(path, value))


def _depth_of_mapping(model: type[BaseModel], path: list[str]) -> int:
    """Length of the prefix of `path` that names the free-form table it ends in."""
    for end in range(1, len(path) + 1):
        if lookup(model, path[:end])[1].is_mapping:
            return end
    return len(path)


def _literal_or_string(text: str) -> Any:
    try:
        return parse_toml_value(text)
    except ValueError:
        return text


def _negations(path: list[str]) -> list[list[str]]:
    """`--section.no-key` and `--no-section.key` both negate `section.key`."""
    candidates = []
    if path[-1].startswith("no_"):
        candidates.append([*path[:-1], path[-1][3:]])
    if len(path) > 1 and path[0].startswith("no_"):
        candidates.append([path[0][3:], *path[1:]])
    return candidates


@dataclass
class CommandLine:
    layers: Layers
    dry_run: bool = False
    help: bool = False


def parse_command_line(model: type[BaseModel], argv: list[str]) -> CommandLine:
    """Walk argv once, applying each source in the order written."""
    result = CommandLine(Layers())
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in ("--help", "-h"):
            result.help = True
            index += 1
        elif token == "--dry-run":
            result.dry_run = True
            index += 1
        elif token == "@" or token.startswith("@"):
            file, index = _file_operand(argv, index)
            add_file(result.layers, model, file)
        elif token.startswith("--"):
            if index + 1 < len(argv) and argv[index + 1].startswith("@") and "=" not in token:
                file, index = _file_operand(argv, index + 1)
                section = [normalise_key(part) for part in token[2:].split(".")]
                add_file(result.layers, model, file, section)
                continue
            values = []
            index += 1
            while index < len(argv) and not _is_option(argv[index]):
                values.append(argv[index])
                index += 1
            add_flag(result.layers, model, token, values)
        else:
            raise ConfigError(
                f"unexpected argument {token!r}: config files are given as `@ file.toml`, keys as `--section.key value`"
            )
    return result


def _is_option(token: str) -> bool:
    return token.startswith("--") or token.startswith("@")


def _file_operand(argv: list[str], index: int) -> tuple[str, int]:
    token = argv[index]
    if token != "@":
        return token[1:], index + 1
    if index + 1 >= len(argv) or _is_option(argv[index + 1]):
        raise ConfigError("`@` must be followed by a TOML file path")
    return argv[index + 1], index + 2


def validate(model: type[ConfigT], layers: Layers) -> ConfigT:
    """Build the config from merged sources; value errors name key, value, expected type and source."""
    try:
        return model.model_validate(layers.data)
    except ValidationError as error:
        raise ConfigError(_format_validation(model, error, layers.origin)) from None


def _format_validation(model: type[BaseModel], error: ValidationError, origin: dict[KeyPath, str]) -> str:
    messages = []
    for item in error.errors():
        loc = tuple(item["loc"])
        dotted = ".".join(kebab(str(part)) for part in loc) or "(top level)"
        where = _describe(origin, loc, "defaults")
        expected = _expected_type(model, loc)
        value = f" = {item['input']!r}" if "input" in item and not isinstance(item["input"], dict) else ""
        hint = f", expected {expected}" if expected else ""
        messages.append(f"invalid value for `{dotted}`{value} (from {where}){hint}: {item['msg']}")
    return "\n".join(messages)


def _expected_type(model: type[BaseModel], loc: KeyPath) -> str:
    path = [part for part in loc if isinstance(part, str)]
    try:
        info, _ = lookup(model, path)
    except UnknownKey:
        return ""
    return annotation_name(info.annotation)


def load_config(model: type[ConfigT], argv: list[str]) -> tuple[ConfigT, CommandLine]:
    """Parse and validate; the returned CommandLine says whether --dry-run or --help were given."""
    command_line = parse_command_line(model, argv)
    if command_line.help:
        return model.model_construct(), command_line
    return validate(model, command_line.layers), command_line


def load_file(model: type[ConfigT], path: str | Path) -> ConfigT:
    """Load one TOML file into a config (used for the resolved config a run writes)."""
    layers = Layers()
    add_file(layers, model, str(path))
    return validate(model, layers)


__all__ = ["CommandLine", "Layers", "deep_merge", "field_kind", "load_config", "load_file", "validate"]
