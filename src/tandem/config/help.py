"""`tandem <cmd> --help`: every config field with its type, default and description, grouped by section."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tandem.config.schema import annotation_name, field_kind, kebab

USAGE = (
    "usage: tandem {command} [@ FILE.toml ...] [--SECTION @ FILE.toml] [--KEY VALUE ...] [--dry-run]\n\n"
    "Config sources, later wins: defaults < `@ file.toml` (merged left to right) < `--section @ file.toml`\n"
    "< `--dotted.kebab-key value` flags. Booleans take `--key` / `--no-key`; list values replace the\n"
    "whole list (`--key a b c` or `--key '[1, 2]'`). `--dry-run` prints the resolved config as TOML."
)


def _default(info: Any, section: BaseModel | None, name: str) -> Any:
    """A field's default: the value its section's declared default sets (`ckpt = CheckpointConfig(interval=50)`,
    `inference = InferenceConfig(port=0)`), else the field's own; PydanticUndefined where it is required."""
    shared = getattr(section, "shared_fields", ())  # flow from the top level: not the section's own
    if section is not None and name in section.model_fields_set and name not in shared:
        return getattr(section, name)
    if info.default is PydanticUndefined and info.default_factory is None:
        return PydanticUndefined
    return info.get_default(call_default_factory=True)


def _shown(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _rows(
    model: type[BaseModel],
    prefix: str,
    groups: dict[str, list[tuple[str, str, str, str]]],
    section: BaseModel | None = None,
) -> None:
    """Fill `groups` (section name -> rows of flag, type, default, description): scalars first, then subsections.
    `section` is the default the parent field declares for this one, whose set values are the defaults shown."""
    title = prefix.rstrip(".") or "general"
    nested = []
    for name, info in model.model_fields.items():
        flag = f"{prefix}{kebab(name)}"
        kind = field_kind(info.annotation)
        default = _default(info, section, name)
        if kind.model is not None or kind.list_of_model is not None:
            nested.append((flag, kind, default if isinstance(default, BaseModel) else None))
            continue
        groups.setdefault(title, []).append(
            (
                flag if "[]" in flag else f"--{flag}",
                annotation_name(info.annotation),
                _shown(default),
                info.description or "",
            )
        )
    for flag, kind, default in nested:
        if kind.model is not None:
            _rows(kind.model, f"{flag}.", groups, default)
        else:
            groups.setdefault(f"[[{flag}]]", [])
            _rows(kind.list_of_model, f"{flag}[].", groups)


def render_help(command: str, summary: str, model: type[BaseModel]) -> str:
    groups: dict[str, list[tuple[str, str, str, str]]] = {}
    _rows(model, "", groups)
    lines = [USAGE.format(command=command), "", summary]
    for section, rows in groups.items():
        lines.append("")
        lines.append(f"[{section}]" if not section.startswith("[[") else section)
        width = max((len(flag) for flag, *_ in rows), default=0)
        for flag, type_name, default, description in rows:
            default_text = f" (default: {default})" if default else ""
            lines.append(f"  {flag.ljust(width)}  {type_name}{default_text}")
            if description:
                lines.append(f"  {' ' * width}    {description}")
    return "\n".join(lines) + "\n"
