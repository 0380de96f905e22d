"""`tandem inference`: the OpenAI-compatible inference server."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from tandem.config.common import RunConfig


class InferenceConfig(RunConfig):
    command: ClassVar[str] = "inference"

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback requires `admin_token` for admin endpoints."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port to listen on (0 picks a free one)."""
    admin_token: str | None = None
    """Bearer token required by /update_weights, /pause and /resume."""
