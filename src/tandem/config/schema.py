"""Walking config models by key path: field lookup, key normalisation, "did you mean" hints."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def normalise_key(key: str) -> str:
    """Flags and files may spell keys in kebab-case; models use snake_case."""
    return key.replace("-", "_")


def kebab(key: str) -> str:
    return key.replace("_", "-")


def _args(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


@dataclass(frozen=True)
class FieldKind:
    """What a field holds, as far as the loader cares."""

    annotation: Any
    model: type[BaseModel] | None = None  # a nested section
    list_of_model: type[BaseModel] | None = None  # an array of tables, e.g. [[source]]
    is_list: bool = False
    or_scalar: bool = False  # a list, or one plain value (`str | list[str]`): one flag value is that value
    is_bool: bool = False
    is_mapping: bool = False  # a free-form table; keys below it are not checked


def field_kind(annotation: Any) -> FieldKind:
    for arg in _args(annotation):
        if _is_model(arg):
            return FieldKind(annotation, model=arg)
    for arg in _args(annotation):
        origin = typing.get_origin(arg) or arg
        if origin in (list, tuple, set, frozenset):
            items = typing.get_args(arg)
            item = items[0] if items else Any
            inner = next((a for a in _args(item) if _is_model(a)), None)
            scalar = any((typing.get_origin(a) or a) not in (list, tuple, set, frozenset) for a in _args(annotation))
            return FieldKind(annotation, list_of_model=inner, is_list=True, or_scalar=scalar)
        if origin is dict or origin is typing.Mapping:
            return FieldKind(annotation, is_mapping=True)
    is_bool = any(arg is bool for arg in _args(annotation))
    return FieldKind(annotation, is_bool=is_bool)


def suggest(
    key: str,
    choices: typing.Iterable[str],
    prefix: typing.Sequence[str | int] = (),
    model: type[BaseModel] | None = None,
) -> str:
    """A ' (did you mean `section.key`?)' hint, or '' when nothing is close: the closest of `choices`, else the
    shallowest field nested in `model` whose own name is `key` (`--lr` -> `optim.lr`)."""
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    nested = [] if close or model is None else nested_fields(model, key)
    if not close and not nested:
        return ""
    path = (*prefix, close[0]) if close else (*prefix, *min(nested, key=len))
    return f" (did you mean `{'.'.join(kebab(str(p)) for p in path)}`?)"


def nested_fields(model: type[BaseModel], name: str, depth: int = 4) -> list[tuple[str, ...]]:
    """The paths of every field named `name` in the sections below `model` (at most `depth` deep)."""
    found: list[tuple[str, ...]] = []
    if depth == 0:
        return found
    for field, info in model.model_fields.items():
        kind = field_kind(info.annotation)
        section = kind.model  # not an array of tables: a flag cannot set one of its items
        if section is None:
            continue
        if name in section.model_fields:
            found.append((field, name))
        found += [(field, *path) for path in nested_fields(section, name, depth - 1) if len(path) > 1]
    return found


class UnknownKey(LookupError):
    def __init__(self, path: list[str], valid: list[str], model: type[BaseModel] | None = None):
        self.path = path
        self.valid = valid
        self.model = model
        """The section the unknown key was looked up in."""
        super().__init__(".".join(path))

    def describe(self) -> str:
        dotted = ".".join(kebab(p) for p in self.path)
        return f"unknown key `{dotted}`{suggest(self.path[-1], self.valid, self.path[:-1], self.model)}"


def lookup(model: type[BaseModel], path: list[str]) -> tuple[FieldInfo, FieldKind]:
    """The field at a dotted path of normalised keys; raises UnknownKey naming the first bad part."""
    current: type[BaseModel] | None = model
    for depth, key in enumerate(path):
        if current is None:
            raise UnknownKey(path[: depth + 1], [])
        fields = current.model_fields
        if key not in fields:
            raise UnknownKey(path[: depth + 1], list(fields), current)
        info = fields[key]
        kind = field_kind(info.annotation)
        if depth == len(path) - 1:
            return info, kind
        if kind.is_mapping:
            return info, kind
        current = kind.model
    raise UnknownKey(path, [])


def annotation_name(annotation: Any) -> str:
    """A short, readable type name for help and error messages."""
    if annotation is None or annotation is type(None):
        return "none"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(annotation_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else annotation_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))
