"""The `shared` weight transport: one buffer of the whole policy that trainer rank 0 fills and the servers on
its node map, so trainer and server may share one GPU (where NCCL refuses two ranks on one device).

The buffer (`tandem.transport.shared_buffer`) holds every tensor in the policy dtype at the offsets of one
`Layout`; on CUDA it lives on the trainer's GPU and each server maps it through its own CUDA IPC handle, on
CPU it is a POSIX shared-memory segment. The rendezvous, offers and answers are `control.py`'s; each server
finds its handle at `buffer/<rank>` in the store when it joins and validates it before mapping anything.

Per policy every trainer rank gathers the full tensors (collective); rank 0 first waits until every server has
answered `done` to the previous policy (so it never overwrites weights a server is still copying), copies the
tensors into the buffer, fences, offers the policy with its layout and returns: the servers take it in while
the trainer trains the next step. A server checks the offer's names, shapes and layout against its model,
pauses its engine between two steps, copies the buffer's views into its parameters in place and answers
`done`. A refusal or failure reaches the trainer at its next hand-off (or at the final policy), naming the
server.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable

import torch

from tandem.transport.shared_buffer import Layout, SharedBuffer, SharedBufferError
from tandem.transport.weights.base import PolicySource
from tandem.transport.weights.control import (
    ControlReceiver,
    ControlSender,
    InMemoryPublisher,
    JoinRequest,
    Manifest,
    Offer,
    WeightTransportError,
    check_offer,
)

logger = logging.getLogger(__name__)


class SharedSender:
    """Trainer rank 0's end: the buffer, the store, and the one policy the servers may still be copying."""

    def __init__(self, manifest: Manifest, device: torch.device, host: str, port: int, timeout_s: float) -> None:
        self.manifest = manifest
        self.layout = Layout.of(manifest)
        self.buffer = SharedBuffer.create(self.layout.nbytes, device)
        self.views = self.buffer.views(self.layout)
        self.control = ControlSender("shared", host, port, timeout_s)
        self.rendezvous = self.control.rendezvous
        self.pending: tuple[int, int] | None = None
        """(sequence number, version) of the last offer, until every server has answered it."""

    def connect(self) -> int:
        """Wait until the inference servers have mapped the buffer; returns how many there are."""
        world_size = self.control.wait_for_members()
        for rank in self.control.ranks():  # a CUDA handle serves one opener
            self.control.store.set(f"buffer/{rank}", json.dumps(self.buffer.handle()))
        self.control.wait_joined()
        logger.info(
            "shared weights: %d inference servers mapped the %.1f MiB buffer on %s",
            world_size - 1,
            self.layout.nbytes / 2**20,
            self.buffer.device,
        )
        return world_size - 1

    def settle(self) -> None:
        """Return once every server serves the last offered policy; WeightTransportError naming one that
        refused or failed it."""
        if self.pending is not None:
            seq, version = self.pending
            self.pending = None
            self.control.collect(seq, ["ready", "done"], f"loading policy {version}")

    def send(self, version: int, tensors: Iterable[torch.Tensor]) -> float:
        """Copy `tensors` (in manifest order and dtype) into the buffer and offer them as policy `version`;
        returns without waiting for the servers (seconds this took, the wait for the previous policy included)."""
        started = time.monotonic()
        self.settle()
        with torch.no_grad():
            for (name, dtype, shape), tensor in zip(self.manifest, tensors, strict=True):
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise WeightTransportError(
                        f"policy {version}: {name} is {tensor.dtype} {tuple(tensor.shape)}, offered {dtype} {shape}"
                    )
                self.views[name].copy_(tensor)
        self.buffer.fence()
        seq = self.control.offer(version, self.manifest, layout=self.layout.to_json())
        self.pending = seq, version
        seconds = time.monotonic() - started
        logger.info("offered policy %d through the shared buffer in %.3fs", version, seconds)
        return seconds

    def close(self) -> None:
        try:
            self.settle()
        except WeightTransportError as error:
            logger.error("shared weights: %s", error)
        self.control.close()
        self.buffer.close()


class SharedReceiver:
    """An inference server's end: maps the trainer's buffer, then hands each offered policy's views over."""

    def __init__(self, join: JoinRequest) -> None:
        self.join = join
        self.control = ControlReceiver(join)
        self.buffer: SharedBuffer | None = None

    def connect(self) -> None:
        self.control.connect()
        what = f"waiting for the shared buffer's handle (rank {self.join.rank})"
        try:
            self.buffer = SharedBuffer.open(json.loads(self.control.get(f"buffer/{self.join.rank}", what)))
        except (SharedBufferError, ValueError, TypeError) as error:
            self.control.joined(f"cannot map the trainer's shared buffer: {error}")
            raise WeightTransportError(f"cannot map the trainer's shared buffer: {error}") from None
        self.control.joined()

    def next_offer(self, running) -> Offer | None:
        return self.control.next_offer(running)

    def _views(self, offer: Offer) -> dict[str, torch.Tensor]:
        """The offer's tensors as views into the buffer, its layout validated against the offer and the buffer."""
        assert self.buffer is not None
        layout = Layout.from_json(offer.extra.get("layout"))
        placed = [(entry.name, entry.dtype, entry.shape) for entry in layout.entries]
        if placed != offer.tensors:
            raise SharedBufferError(f"policy {offer.version}: the layout does not place the offered tensors")
        return self.buffer.views(layout)

    def check(self, offer: Offer, targets: dict[str, torch.Tensor]) -> str | None:
        problem = check_offer(offer, targets)
        if problem is None:
            try:
                self._views(offer)
            except (SharedBufferError, TypeError) as error:
                return f"policy {offer.version}: {error}"
        return problem

    def receive(self, offer: Offer, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checked offer's tensors (views into the buffer), for the engine to copy into its parameters."""
        self.control.answer("ready", offer)
        return self._views(offer)

    def acknowledge(self, offer: Offer) -> None:
        """The engine has copied the views in: answer, once the copies are complete, so the trainer may reuse
        the buffer."""
        assert self.buffer is not None
        self.buffer.fence()
        self.control.answer("done", offer)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()


class SharedPublisher(InMemoryPublisher):
    """The trainer's end: every rank gathers each full tensor (collective), rank 0 copies it into the buffer."""

    def __init__(self, source: PolicySource, host: str, port: int, timeout_s: float) -> None:
        super().__init__(source, lambda: SharedSender(source.manifest, source.device, host, port, timeout_s))

    def hand_off(self, version: int) -> None:
        tensors = self.source.tensors()
        if self.sender is not None:
            self.sender.send(version, tensors)
        else:
            for _ in tensors:
                pass

    def settle(self) -> None:
        if self.sender is not None:
            self.sender.settle()
