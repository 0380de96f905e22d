"""How policy N goes from the trainer to every inference server: one interface, one module per kind.

- `file.py`: a Hugging Face directory per policy under `<run>/policies/`; the orchestrator has every server
  load it (pause, `/update_weights`, resume). Any server that speaks the contract takes it, vLLM included.
- `broadcast.py`: trainer rank 0 sends each tensor to every server over torch.distributed (NCCL across GPUs,
  gloo on CPU); the trainer waits until every server serves it.
- `shared.py`: trainer rank 0 keeps one flat buffer of the whole policy that the servers on its node map (CUDA
  IPC on the trainer's GPU, POSIX shared memory on CPU), so trainer and server may share one GPU; the trainer
  fills it and offers the policy, then goes on training while the servers copy it in.

Both in-memory kinds share one control plane (`control.py`: rendezvous, offers, answers, deadlines) and one
orchestrator follower (`follower.py`); the servers' end is `tandem.inference.weights_receiver`. Whatever the
kind, the final policy is written as a directory and is then all `policies/` holds (`publish_final`): it is the
run's result.

The trainer side (`WeightPublisher`) is built by `tandem.trainer.publish.make_publisher`, which hands a
`PolicySource` over, so this package never imports the trainer's modules (the inference server imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

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


def make_follower(transport: Transport, pool: Any, run_dir: Path, startup_timeout_s: float) -> PolicyFollower:
    """The orchestrator's follower of `transport` over `pool` (an `InferencePool`: its `clients`,
    `config.base_urls`, `version` and `loaded`)."""
    if transport == "file":
        from tandem.transport.weights.file import FileFollower

        return FileFollower(pool, run_dir)
    from tandem.transport.weights.follower import JoinedFollower

    return JoinedFollower(transport, pool, run_dir, startup_timeout_s)
