"""The base class of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment.

    Field docstrings become the one-line descriptions in `tandem <cmd> --help`,
    so every field carries one (`use_attribute_docstrings`).
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )
