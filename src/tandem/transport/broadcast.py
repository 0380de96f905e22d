"""Policies from the trainer to inference over torch.distributed: a broadcast from trainer rank 0, tensor by tensor.

The file path (`policies.py`) writes every policy to disk; this one sends it to every inference server at
once (NCCL between GPUs, gloo on CPU), one tensor at a time, straight into the servers' weights, so no side
ever holds a second full copy. The group is separate from the trainer's own: trainer rank 0 is rank 0, server
i of the orchestrator's list is rank i + 1.

- **Rendezvous.** Trainer rank 0 hosts a TCPStore and announces `{host, port, backend}` in
  `<run>/weight_broadcast.json`. The orchestrator asks each server to join (`POST /weights/broadcast/join`
  with the rendezvous, its rank and the group size); joining servers set `world_size` in the store, and once
  every member has built its process group a one-element broadcast proves they are all there.
- **Per policy** (sequence number s, counted by both ends): the trainer sets `offer/<s>` to the version and
  the list of `[name, dtype, shape]`; each server checks the list against its model and answers
  `ready/<s>/<rank>` (`ok`, or why not); the trainer broadcasts the tensors in that order; each server copies
  them in, serves the new version and answers `done/<s>/<rank>`.
- **Failures.** Every wait has a deadline (`timeout_s`): a member that dies, refuses, or stops answering ends
  the wait with a `WeightBroadcastError` naming the member and the step, and the group is aborted, so
  neither end hangs. Control messages go through the store (TCP), so nothing waits on the GPU between
  policies.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

ANNOUNCE_FILE = "weight_broadcast.json"
_POLL_S = 0.01
Backend = Literal["nccl", "gloo"]


class WeightBroadcastError(RuntimeError):
    """A member of the weight broadcast failed, refused or stopped answering; the message says which and where."""


class Rendezvous(BaseModel):
    """Where the trainer's store listens and which backend the group uses (`<run>/weight_broadcast.json`)."""

    model_config = ConfigDict(extra="forbid")
    host: str
    port: int = Field(ge=1, le=65535)
    backend: Backend
    timeout_s: float = Field(gt=0)
    """The deadline of every wait, the same for all members (the trainer's `weights.timeout_s`)."""


class JoinRequest(Rendezvous):
    """`POST /weights/broadcast/join`: the rendezvous and this server's rank in the group."""

    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)


class ReceiverStatus(BaseModel):
    """`GET /weights/broadcast`: what a server's receiving end is doing."""

    state: Literal["idle", "joining", "connected", "receiving", "failed", "stopped"]
    policy_version: int
    """The version the server serves (set once a broadcast policy is fully copied in)."""
    policies: int = 0
    """Policies received over the broadcast so far."""
    error: str | None = None


def announce_path(run_dir: Path) -> Path:
    return run_dir / ANNOUNCE_FILE


def _store(host: str, port: int, timeout_s: float, master: bool) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if master:
            return dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        role = "host" if master else "reach"
        raise WeightBroadcastError(f"cannot {role} the weight-broadcast store at {host}:{port}: {error}") from None


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
    """Broadcast from rank 0 into `tensor` on every member, or raise WeightBroadcastError within `timeout_s`."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        work = group.broadcast([tensor], options)
        while not work.is_completed():
            if time.monotonic() > deadline:
                _abort(group)
                raise WeightBroadcastError(
                    f"{what}: a member of the weight broadcast did not answer within {timeout_s:g}s"
                )
            time.sleep(_POLL_S / 10)
        work.wait()
    except WeightBroadcastError:
        raise
    except RuntimeError as error:
        raise WeightBroadcastError(f"{what}: the weight broadcast failed: {error}") from None


def _wait_key(store: dist.Store, key: str, timeout_s: float, what: str, alive: Callable[[], bool] = lambda: True):
    """The value of `key` once a member sets it; WeightBroadcastError after `timeout_s` or if the store is gone."""
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise WeightBroadcastError(f"{what}: no answer within {timeout_s:g}s")
            if not alive():
                return None
            time.sleep(_POLL_S)
        return store.get(key).decode()
    except WeightBroadcastError:
        raise
    except RuntimeError as error:
        raise WeightBroadcastError(f"{what}: lost the weight-broadcast store: {error}") from None


@dataclass(frozen=True)
class Offer:
    seq: int
    version: int
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightBroadcastError(f"unknown dtype {name!r} in a weight-broadcast offer")
    return dtype


class WeightSender:
    """Trainer rank 0's end: hosts the store, waits for the servers to join, then sends policies."""

    def __init__(self, host: str, port: int, backend: Backend, timeout_s: float) -> None:
        self.backend, self.timeout_s = backend, timeout_s
        self.store = _store(host, port, timeout_s, master=True)
        self.rendezvous = Rendezvous(host=host, port=self.store.port, backend=backend, timeout_s=timeout_s)
        self.group: dist.ProcessGroup | None = None
        self.world_size = 0
        self.seq = 0
        self.broken = False

    def connect(self) -> int:
        """Wait until the inference servers have joined; returns how many there are."""
        what = f"waiting for inference servers to join the weight broadcast at {self.rendezvous.host}:{self.rendezvous.port}"
        self.world_size = int(_wait_key(self.store, "world_size", self.timeout_s, what))
        try:
            self.group = _group(self.store, 0, self.world_size, self.backend, self.timeout_s)
        except RuntimeError as error:
            raise WeightBroadcastError(f"{what}: {error}") from None
        _broadcast(self.group, torch.zeros(1, device=_wire_device(self.backend)), "joining", self.timeout_s)
        logger.info("weight broadcast: %d inference servers joined (%s)", self.world_size - 1, self.backend)
        return self.world_size - 1

    def send(
        self, version: int, manifest: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Iterable[torch.Tensor]
    ) -> float:
        """Offer policy `version` (names, dtypes, shapes in sending order), then broadcast `tensors` in that order
        (each already in its manifest dtype); returns once every server serves it (seconds taken)."""
        if self.group is None:
            self.connect()
        try:
            return self._send(version, manifest, tensors)
        except WeightBroadcastError:
            self.broken = True
            raise

    def _send(self, version: int, manifest: list, tensors: Iterable[torch.Tensor]) -> float:
        started = time.monotonic()
        self.seq += 1
        offer = {"version": version, "tensors": [[name, str(dtype), list(shape)] for name, dtype, shape in manifest]}
        self.store.set(f"offer/{self.seq}", json.dumps(offer))
        self._acks("ready", f"offering policy {version}")
        device = _wire_device(self.backend)
        count = 0
        for (name, dtype, shape), tensor in zip(manifest, tensors, strict=True):
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise WeightBroadcastError(
                    f"policy {version}: {name} is {tensor.dtype} {tuple(tensor.shape)}, offered {dtype} {shape}"
                )
            _broadcast(self.group, tensor.to(device).contiguous(), f"sending policy {version}: {name}", self.timeout_s)
            count += 1
        self._acks("done", f"loading policy {version}")
        seconds = time.monotonic() - started
        logger.info(
            "broadcast policy %d (%d tensors) to %d servers in %.2fs", version, count, self.world_size - 1, seconds
        )
        return seconds

    def _acks(self, kind: str, what: str) -> None:
        for rank in range(1, self.world_size):
            answer = _wait_key(
                self.store, f"{kind}/{self.seq}/{rank}", self.timeout_s, f"{what} (inference rank {rank})"
            )
            if answer != "ok":
                _abort(self.group)
                raise WeightBroadcastError(f"{what}: inference rank {rank} refused: {answer}")

    def close(self) -> None:
        """Tell the servers no policy follows and wait (briefly) until they have heard it, so that the store
        going away with this process does not look like a failure to them."""
        if self.group is not None and not self.broken:
            self.store.set("closed", "1")
            for rank in range(1, self.world_size):
                try:
                    _wait_key(self.store, f"bye/{rank}", min(self.timeout_s, 10.0), "closing")
                except WeightBroadcastError:
                    logger.warning("inference rank %d did not acknowledge the end of the weight broadcast", rank)
        _abort(self.group)
        self.group = None


class WeightReceiver:
    """An inference server's end: joins the group, then takes each offered policy into its weights."""

    def __init__(self, join: JoinRequest) -> None:
        self.join = join
        self.store: dist.TCPStore | None = None
        self.group: dist.ProcessGroup | None = None
        self.seq = 0

    def connect(self) -> None:
        join = self.join
        if join.backend == "nccl" and not torch.cuda.is_available():
            raise WeightBroadcastError("the trainer broadcasts over NCCL, but this server has no CUDA device")
        self.store = _store(join.host, join.port, join.timeout_s, master=False)
        self.store.set("world_size", str(join.world_size))
        try:
            self.group = _group(self.store, join.rank, join.world_size, join.backend, join.timeout_s)
        except RuntimeError as error:
            raise WeightBroadcastError(f"joining the weight broadcast as rank {join.rank}: {error}") from None
        _broadcast(self.group, torch.zeros(1, device=_wire_device(join.backend)), "joining", join.timeout_s)

    def next_offer(self, running: Callable[[], bool]) -> Offer | None:
        """The trainer's next policy; None once the trainer closes the broadcast or `running()` turns false."""
        store = self.store
        assert store is not None
        key = f"offer/{self.seq + 1}"

        def waiting() -> bool:
            return running() and not store.check(["closed"])

        value = _wait_key(store, key, float("inf"), "waiting for the next policy", alive=waiting)
        if value is None:
            if store.check(["closed"]):
                store.set(f"bye/{self.join.rank}", "1")
            return None
        self.seq += 1
        offer = json.loads(value)
        tensors = [(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in offer["tensors"]]
        return Offer(self.seq, offer["version"], tensors)

    def check(self, offer: Offer, targets: dict[str, torch.Tensor]) -> str | None:
        """Why `targets` (the model's weights by name) cannot take `offer`, or None if they can."""
        names = [name for name, _, _ in offer.tensors]
        missing, unexpected = sorted(set(targets) - set(names)), sorted(set(names) - set(targets))
        if missing or unexpected:
            return f"policy {offer.version} holds a different model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        for name, _, shape in offer.tensors:
            if tuple(targets[name].shape) != shape:
                return f"policy {offer.version}: {name} has shape {shape}, this server's model {tuple(targets[name].shape)}"
        return None

    def refuse(self, offer: Offer, reason: str) -> None:
        assert self.store is not None
        self.store.set(f"ready/{offer.seq}/{self.join.rank}", reason)

    def receive(self, offer: Offer, targets: dict[str, torch.Tensor]) -> None:
        """Receive every tensor of a checked offer into `targets`, in place (through a staging tensor only when the
        dtype or device differs from what travels)."""
        assert self.store is not None and self.group is not None
        self.store.set(f"ready/{offer.seq}/{self.join.rank}", "ok")
        device = _wire_device(self.join.backend)
        with torch.no_grad():
            for name, dtype, shape in offer.tensors:
                target = targets[name]
                direct = target.dtype == dtype and target.device == device and target.is_contiguous()
                buffer = target if direct else torch.empty(shape, dtype=dtype, device=device)
                _broadcast(self.group, buffer, f"receiving policy {offer.version}: {name}", self.join.timeout_s)
                if not direct:
                    target.copy_(buffer)

    def acknowledge(self, offer: Offer) -> None:
        assert self.store is not None
        self.store.set(f"done/{offer.seq}/{self.join.rank}", "ok")

    def close(self) -> None:
        _abort(self.group)
        self.group = None
