"""`tandem eval`: environments against an OpenAI-compatible server."""

from __future__ import annotations

from typing import ClassVar

from tandem.config.common import RunConfig


class EvalConfig(RunConfig):
    command: ClassVar[str] = "eval"

    base_url: str | None = None
    """OpenAI-compatible server to evaluate against (default: start the built-in one for `model.name`)."""
    api_key: str | None = None
    """API key sent to `base_url`."""
