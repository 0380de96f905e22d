"""`tandem verifiers-wheels`: the wheelhouse verifiers' harness programs install from when no index is reachable."""

from __future__ import annotations

from pydantic import Field

from tandem.config.base import Section


class VerifiersWheelsConfig(Section):
    """Download, once and while a package index is reachable, the wheels verifiers' subprocess runtime installs each
    harness program from (its `uv` script's dependencies), so that verifiers environments run with no index."""

    dir: str | None = None
    """Where the wheels go (default: $TANDEM_VERIFIERS_WHEELS, else ~/.cache/tandem/verifiers-wheels); runs read the same place."""
    requirements: list[str] = Field(default_factory=list)
    """More requirements to include (a harness of your own whose script needs other packages)."""
