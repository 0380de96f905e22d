"""The base class of every config section."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment.

    Field docstrings become the one-line descriptions in `tandem <cmd> --help`,
    so every field carries one (`use_attribute_docstrings`). No float may be NaN or infinite
    (`allow_inf_nan`): `inf` passes a lower bound such as `gt=0`, a field without bounds takes all three,
    and no setting means "unbounded" by being infinite, so one rule refuses them everywhere. Free-form
    tables and lists (an environment's `args`) are held to it too (`_finite_inside`): TOML cannot carry their
    infinities into a run's saved config, so a resumed or rerun config would silently lose them.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    @field_validator("*", mode="after")
    @classmethod
    def _finite_inside(cls, value: Any) -> Any:
        if isinstance(value, dict | list | tuple) and (bad := _non_finite(value)) is not None:
            raise ValueError(f"holds {bad}: no config number may be NaN or infinite")
        return value


def _non_finite(value: Any) -> float | None:
    """The first NaN or infinite float inside nested dicts, lists and tuples, walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return None
