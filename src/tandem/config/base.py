"""The base class of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment.

    Field docstrings become the one-line descriptions in `tandem <cmd> --help`,
    so every field carries one (`use_attribute_docstrings`). No float may be NaN or infinite
    (`allow_inf_nan`): `inf` passes a lower bound such as `gt=0`, a field without bounds takes all three,
    and no setting means "unbounded" by being infinite, so one rule refuses them everywhere.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )
