"""`tandem dashboard`: a local web page over runs and evals."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from tandem.config.base import Section


class DashboardConfig(Section):
    outputs: Path = Path("outputs")
    """Directory whose runs and evals the dashboard lists."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(8265, ge=0, le=65535)
    """TCP port to listen on."""
