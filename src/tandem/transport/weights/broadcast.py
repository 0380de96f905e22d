"""The `broadcast` weight transport: trainer rank 0 sends each policy to every server over torch.distributed.

NCCL between GPUs, gloo on CPU; one tensor at a time, gathered on the trainer's devices and received straight
into the servers' weights, so no side ever holds a second full copy and nothing touches the disk. The group is
separate from the trainer's own: trainer rank 0 is rank 0, server i of the orchestrator's list rank i + 1.
The rendezvous, offers and answers are `control.py`'s; per policy the trainer offers it, waits for every
`ready`, broadcasts the tensors in the offered order and waits for every `done`, so it returns once every
server serves the policy. A broadcast that does not complete within `timeout_s` aborts the group.
NCCL refuses two ranks on one GPU: a trainer sharing its GPU with a server uses `shared`.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from tandem.transport.weights.base import PolicySource
from tandem.transport.weights.control import (
    Backend,
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

_POLL_S = 0.001


def _group(store: dist.Store, rank: int, world_size: int, backend: Backend, timeout_s: float) -> dist.ProcessGroup:
    """A process group of its own (not the default one, which the trainer's ranks use)."""
    prefixed = dist.PrefixStore("group", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def _wire_device(backend: Backend) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _abort(group: dist.ProcessGroup | None) -> None:
    abort = getattr(group, "abort", None)
    if abort is not None:
        try:
            abort()
        except RuntimeError as error:  # already broken: nothing left to stop
            logger.debug("aborting the weight-broadcast group: %s", error)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, what: str, timeout_s: float) -> None:
    """Broadcast from rank 0 into `tensor` on every member, or raise WeightTransportError within `timeout_s`."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        work = group.broadcast([tensor], options)
        while not work.is_completed():
            if time.monotonic() > deadline:
                _abort(group)
                raise WeightTransportError(
                    f"{what}: a member of the weight broadcast did not answer within {timeout_s:g}s"
                )
            time.sleep(_POLL_S)
        work.wait()
    except WeightTransportError:
        raise
    except RuntimeError as error:
        raise WeightTransportError(f"{what}: the weight broadcast failed: {error}") from None


class BroadcastSender:
    """Trainer rank 0's end: hosts the store, waits for the servers to join, then sends policies."""

    def __init__(self, host: str, port: int, backend: Backend, timeout_s: float) -> None:
        self.backend, self.timeout_s = backend, timeout_s
        self.control = ControlSender("broadcast", host, port, timeout_s, backend)
        self.control.on_failure = lambda: _abort(self.group)
        self.rendezvous = self.control.rendezvous
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> int:
        """Wait until the inference servers have joined; returns how many there are."""
        world_size = self.control.wait_for_members()
        try:
            self.group = _group(self.control.store, 0, world_size, self.backend, self.timeout_s)
        except RuntimeError as error:
            raise WeightTransportError(f"forming the weight-broadcast group: {error}") from None
        _broadcast(self.group, torch.zeros(1, device=_wire_device(self.backend)), "joining", self.timeout_s)
        self.control.wait_joined()
        logger.info("weight broadcast: %d inference servers joined (%s)", world_size - 1, self.backend)
        return world_size - 1

    def send(self, version: int, manifest: Manifest, tensors: Iterable[torch.Tensor]) -> float:
        """Offer policy `version` (names, dtypes, shapes in sending order), then broadcast `tensors` in that order
        (each already in its manifest dtype); returns once every server serves it (seconds taken)."""
        if self.group is None:
            self.connect()
        started = time.monotonic()
        seq = self.control.offer(version, manifest)
        self.control.collect(seq, ["ready"], f"offering policy {version}")
        device = _wire_device(self.backend)
        count = 0
        try:
            for (name, dtype, shape), tensor in zip(manifest, tensors, strict=True):
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise WeightTransportError(
                        f"policy {version}: {name} is {tensor.dtype} {tuple(tensor.shape)}, offered {dtype} {shape}"
                    )
                what = f"sending policy {version}: {name}"
                _broadcast(self.group, tensor.to(device).contiguous(), what, self.timeout_s)
                count += 1
        except WeightTransportError:
            self.control.fail()
            raise
        self.control.collect(seq, ["done"], f"loading policy {version}")
        seconds = time.monotonic() - started
        logger.info(
            "broadcast policy %d (%d tensors) to %d servers in %.2fs",
            version,
            count,
            self.control.world_size - 1,
            seconds,
        )
        return seconds

    def close(self) -> None:
        self.control.close()
        _abort(self.group)
        self.group = None


class BroadcastReceiver:
    """An inference server's end: joins the group, then receives each offered policy into its weights."""

    def __init__(self, join: JoinRequest) -> None:
        self.join = join
        self.control = ControlReceiver(join)
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        join = self.join
        if join.backend == "nccl" and not torch.cuda.is_available():
            raise WeightTransportError("the trainer broadcasts over NCCL, but this server has no CUDA device")
        store = self.control.connect()
        try:
            self.group = _group(store, join.rank, join.world_size, join.backend, join.timeout_s)
        except RuntimeError as error:
            raise WeightTransportError(f"joining the weight broadcast as rank {join.rank}: {error}") from None
        _broadcast(self.group, torch.zeros(1, device=_wire_device(join.backend)), "joining", join.timeout_s)
        self.control.joined()

    def next_offer(self, running) -> Offer | None:
        return self.control.next_offer(running)

    def check(self, offer: Offer, targets: dict[str, torch.Tensor]) -> str | None:
        return check_offer(offer, targets)

    def receive(self, offer: Offer, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Receive every tensor of a checked offer into `targets`, in place (through a staging tensor only when the
        dtype or device differs from what travels); returns `targets`, which then hold the policy."""
        assert self.group is not None
        self.control.answer("ready", offer)
        device = _wire_device(self.join.backend)
        with torch.no_grad():
            for name, dtype, shape in offer.tensors:
                target = targets[name]
                direct = target.dtype == dtype and target.device == device and target.is_contiguous()
                buffer = target if direct else torch.empty(shape, dtype=dtype, device=device)
                _broadcast(self.group, buffer, f"receiving policy {offer.version}: {name}", self.join.timeout_s)
                if not direct:
                    target.copy_(buffer)
        return targets

    def acknowledge(self, offer: Offer) -> None:
        self.control.answer("done", offer)

    def close(self) -> None:
        _abort(self.group)
        self.group = None


class BroadcastPublisher(InMemoryPublisher):
    """The trainer's end: every rank gathers each full tensor (collective), rank 0 broadcasts it."""

    def __init__(self, source: PolicySource, host: str, port: int, backend: Backend, timeout_s: float) -> None:
        super().__init__(source, lambda: BroadcastSender(host, port, backend, timeout_s))

    def hand_off(self, version: int) -> None:
        tensors = self.source.tensors()
        if self.sender is not None:
            self.sender.send(version, self.source.manifest, tensors)
        else:
            for _ in tensors:
                pass
