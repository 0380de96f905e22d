"""The interface of the weight transports, which every kind implements: the trainer's end (`WeightPublisher`), the
orchestrator's end (`PolicyFollower`), what a publisher takes from the trainer (`PolicySource`), and the final
policy every kind writes the same way (`publish_final`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from tandem.transport.policies import prune_policies

Transport = Literal["file", "broadcast", "shared"]


@dataclass(frozen=True)
class PolicySource:
    """What a publisher needs from the trainer, without importing it."""

    run_dir: Path
    final_version: int
    """The last policy (`max_steps`), always written as a directory."""
    is_main: bool
    """Trainer rank 0, the rank that talks to the servers."""
    device: torch.device
    manifest: list[tuple[str, torch.dtype, tuple[int, ...]]]
    """Every tensor of a policy in `tensors`' order: state-dict name, the policy dtype, the full shape."""
    tensors: Callable[[], Iterator[torch.Tensor]]
    """The current full tensors in manifest order and dtype; collective: every rank iterates to the end."""
    export: Callable[[int], None]
    """Write policy N as a complete directory `<run>/policies/step-N/`; collective."""


def publish_final(source: PolicySource) -> None:
    """Write the final policy as a directory, then prune every older one (`transport.policies.prune_policies`):
    whatever the kind, a finished run's `policies/` holds its result alone. Collective, as `export` is."""
    source.export(source.final_version)
    if source.is_main:
        prune_policies(source.run_dir / "policies", source.final_version)


class WeightPublisher(Protocol):
    """The trainer's end: every rank calls every method (the gathers are collective)."""

    def resumed(self, version: int) -> None:
        """Training continues from checkpoint `version`: make sure the servers can get policy `version`."""

    def publish(self, version: int) -> None:
        """Hand policy `version` (the current weights) over."""

    def close(self) -> None:
        """No policy follows."""


class PolicyFollower(Protocol):
    """The orchestrator's end: makes every server serve the newest policy and sets `pool.version` (the version
    all of them serve) and `pool.loaded`."""

    async def start(self) -> None:
        """Get the servers ready to take policies (join the trainer's hand-off)."""

    async def poll(self) -> None:
        """One round: bring every server to the newest policy there is, or learn what they serve; raises if a
        server failed."""
