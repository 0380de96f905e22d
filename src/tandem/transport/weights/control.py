"""The control plane of the in-memory weight transports (`broadcast`, `shared`): one protocol, both kinds.

The weights themselves travel over a torch.distributed broadcast or through one shared buffer; what is said
about them goes through a TCPStore hosted by trainer rank 0, so nothing waits on a GPU between policies.

- **Rendezvous.** Trainer rank 0 hosts the store and announces `{kind, host, port, timeout_s, backend}` in
  `<run>/weights_rendezvous.json`. The orchestrator asks each server to join (`POST /weights/join` with the
  rendezvous, its rank and the group size; server i of its list is rank i + 1). A joining server sets
  `world_size`, does what its kind needs (form the process group; map the buffer whose handle the trainer left
  at `buffer/<rank>`) and answers `joined/<rank>`: `ok`, or why it could not.
- **Per policy** (sequence number s, counted by both ends): the trainer sets `offer/<s>` to the version, the
  list of `[name, dtype, shape]` and what its kind adds (the buffer layout); each server checks the list
  against its model and answers `ready/<s>/<rank>` (`ok`, or why not), takes the weights in, serves the new
  version and answers `done/<s>/<rank>` (`ok`, or the error that stopped it).
- **Failures.** Every wait has a deadline (`timeout_s`): a member that dies, refuses, or stops answering ends
  the wait with a `WeightTransportError` naming the member and the policy, so neither end hangs.
- **End.** The trainer sets `closed`; each server answers `bye/<rank>` and stops listening without an error.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.files import atomic_write_text
from tandem.transport.shared_buffer import DTYPES
from tandem.transport.weights.base import PolicySource, publish_final

logger = logging.getLogger(__name__)

ANNOUNCE_FILE = "weights_rendezvous.json"
_POLL_S = 0.01
Kind = Literal["broadcast", "shared"]
Backend = Literal["nccl", "gloo"]
Manifest = list[tuple[str, torch.dtype, tuple[int, ...]]]
"""Each tensor of a policy, in sending order: its state-dict name, dtype and full shape."""


class WeightTransportError(RuntimeError):
    """A member of an in-memory weight hand-off failed, refused or stopped answering; the message says which
    and where."""


class Rendezvous(BaseModel):
    """Where the trainer's store listens and how the weights travel (`<run>/weights_rendezvous.json`)."""

    model_config = ConfigDict(extra="forbid")
    kind: Kind
    host: str
    port: int = Field(ge=1, le=65535)
    timeout_s: float = Field(gt=0)
    """The deadline of every wait, the same for all members (the trainer's `weights.timeout_s`)."""
    backend: Backend | None = None
    """broadcast: the torch.distributed backend of the group (shared: none)."""

    @model_validator(mode="after")
    def _backend_for_broadcast_only(self) -> Rendezvous:
        if (self.kind == "broadcast") != (self.backend is not None):
            raise ValueError("a broadcast rendezvous names its backend; a shared one names none")
        return self


class JoinRequest(Rendezvous):
    """`POST /weights/join`: the rendezvous and this server's rank in the group."""

    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)


class ReceiverStatus(BaseModel):
    """`GET /weights`: what a server's receiving end is doing."""

    state: Literal["idle", "joining", "connected", "receiving", "failed", "stopped"]
    policy_version: int
    """The version the server serves (set once a policy is fully copied in)."""
    policies: int = 0
    """Policies received in memory so far."""
    error: str | None = None


def announce_path(run_dir: Path) -> Path:
    return run_dir / ANNOUNCE_FILE


@dataclass(frozen=True)
class Offer:
    seq: int
    version: int
    tensors: Manifest
    extra: dict[str, Any] = field(default_factory=dict)
    """What the kind adds to the offer (shared: the buffer layout)."""


def open_store(host: str, port: int, timeout_s: float, master: bool) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if master:
            return dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        role = "host" if master else "reach"
        raise WeightTransportError(f"cannot {role} the weights store at {host}:{port}: {error}") from None


def wait_key(
    store: dist.Store, key: str, timeout_s: float, what: str, alive: Callable[[], bool] = lambda: True
) -> str | None:
    """The value of `key` once a member sets it; WeightTransportError after `timeout_s` or if the store is gone;
    None as soon as `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise WeightTransportError(f"{what}: no answer within {timeout_s:g}s")
            if not alive():
                return None
            time.sleep(_POLL_S)
        return store.get(key).decode()
    except WeightTransportError:
        raise
    except RuntimeError as error:
        raise WeightTransportError(f"{what}: lost the weights store: {error}") from None


def _dtype(name: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise WeightTransportError(f"unknown dtype {name!r} in a weights offer")
    return dtype


class ControlSender:
    """Trainer rank 0's end of the control plane: hosts the store, waits for the servers, offers policies and
    collects the answers. `on_failure` runs before any error is raised (the broadcast aborts its group)."""

    def __init__(self, kind: Kind, host: str, port: int, timeout_s: float, backend: Backend | None = None) -> None:
        self.timeout_s = timeout_s
        self.store = open_store(host, port, timeout_s, master=True)
        self.rendezvous = Rendezvous(kind=kind, host=host, port=self.store.port, timeout_s=timeout_s, backend=backend)
        self.world_size = 0
        self.seq = 0
        self.broken = False
        self.on_failure: Callable[[], None] = lambda: None

    def wait_for_members(self) -> int:
        """The group's size (the trainer and every server), once the first server has joined."""
        where = f"{self.rendezvous.host}:{self.rendezvous.port}"
        what = f"waiting for inference servers to join the weight {self.rendezvous.kind} at {where}"
        self.world_size = int(wait_key(self.store, "world_size", self.timeout_s, what))
        return self.world_size

    def ranks(self) -> range:
        return range(1, self.world_size)

    def wait_joined(self) -> None:
        """Return once every server has joined; WeightTransportError naming one that could not."""
        for rank in self.ranks():
            self._expect_ok(f"joined/{rank}", f"inference rank {rank} joining the weight {self.rendezvous.kind}")

    def offer(self, version: int, manifest: Manifest, **extra: Any) -> int:
        """Offer policy `version`; returns its sequence number."""
        self.seq += 1
        tensors = [[name, str(dtype).removeprefix("torch."), list(shape)] for name, dtype, shape in manifest]
        self.store.set(f"offer/{self.seq}", json.dumps({"version": version, "tensors": tensors, **extra}))
        return self.seq

    def collect(self, seq: int, stages: Iterable[str], what: str) -> None:
        """Wait for every server's `stages` answers (`ready`, `done`) to offer `seq`; WeightTransportError naming
        the first server that refused, failed or stayed silent."""
        for stage in stages:
            for rank in self.ranks():
                self._expect_ok(f"{stage}/{seq}/{rank}", f"{what} (inference rank {rank})")

    def _expect_ok(self, key: str, what: str) -> None:
        try:
            answer = wait_key(self.store, key, self.timeout_s, what)
        except WeightTransportError:
            self.fail()
            raise
        if answer != "ok":
            self.fail()
            raise WeightTransportError(f"{what}: refused: {answer}")

    def fail(self) -> None:
        self.broken = True
        self.on_failure()

    def close(self) -> None:
        """Tell the servers no policy follows and wait (briefly) until they have heard it, so that the store
        going away with this process does not look like a failure to them."""
        if self.world_size and not self.broken:
            self.store.set("closed", "1")
            for rank in self.ranks():
                try:
                    wait_key(self.store, f"bye/{rank}", min(self.timeout_s, 10.0), "closing")
                except WeightTransportError:
                    logger.warning("inference rank %d did not acknowledge the end of the weight hand-off", rank)


class ControlReceiver:
    """An inference server's end of the control plane: joins, reads each offer, answers it."""

    def __init__(self, join: JoinRequest) -> None:
        self.join = join
        self.store: dist.TCPStore | None = None
        self.seq = 0

    def connect(self) -> dist.TCPStore:
        join = self.join
        self.store = open_store(join.host, join.port, join.timeout_s, master=False)
        self.store.set("world_size", str(join.world_size))
        return self.store

    def get(self, key: str, what: str) -> str:
        """A value the trainer leaves for this server (a buffer handle), within the deadline."""
        assert self.store is not None
        return wait_key(self.store, key, self.join.timeout_s, what)

    def joined(self, answer: str = "ok") -> None:
        assert self.store is not None
        self.store.set(f"joined/{self.join.rank}", answer)

    def next_offer(self, running: Callable[[], bool]) -> Offer | None:
        """The trainer's next policy; None once the trainer closes the hand-off or `running()` turns false."""
        store = self.store
        assert store is not None

        def waiting() -> bool:
            return running() and not store.check(["closed"])

        value = wait_key(store, f"offer/{self.seq + 1}", float("inf"), "waiting for the next policy", alive=waiting)
        if value is None:
            if store.check(["closed"]):
                store.set(f"bye/{self.join.rank}", "1")
            return None
        self.seq += 1
        offer = json.loads(value)
        tensors = [(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in offer.pop("tensors")]
        return Offer(self.seq, offer.pop("version"), tensors, offer)

    def answer(self, stage: str, offer: Offer, value: str = "ok") -> None:
        """Answer `stage` (`ready`, `done`) of `offer`: `ok`, or why not."""
        assert self.store is not None
        self.store.set(f"{stage}/{offer.seq}/{self.join.rank}", value)


def check_same_model(
    served: Mapping[str, Sequence[int]], offered: Mapping[str, Sequence[int]], source: str
) -> str | None:
    """Why the weights `source` offers (tensor name -> shape) are not the served model's (`served`), or None when
    they are. The one check of every way new weights reach a server: an in-memory offer (`check_offer`), a
    checkpoint directory on the built-in engine and on vLLM (`tandem.inference.weights`)."""
    missing, unexpected = sorted(set(served) - set(offered)), sorted(set(offered) - set(served))
    if missing or unexpected:
        return (
            f"{source} holds a different model than the one being served: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, shape in offered.items():
        if tuple(shape) != tuple(served[name]):
            return f"{source}: {name} has shape {tuple(shape)}, the served model's {tuple(served[name])}"
    return None


def check_offer(offer: Offer, targets: dict[str, torch.Tensor]) -> str | None:
    """Why `targets` (the model's weights by name) cannot take `offer`, or None if they can: a different model,
    or a tensor that does not travel as floating point."""
    source = f"policy {offer.version}"
    offered = {name: shape for name, _, shape in offer.tensors}
    problem = check_same_model({name: tuple(t.shape) for name, t in targets.items()}, offered, source)
    if problem is not None:
        return problem
    for name, dtype, _ in offer.tensors:
        if not dtype.is_floating_point:
            return f"{source}: {name} comes as {dtype}, not a floating-point dtype"
    return None


class InMemorySender(Protocol):
    """Trainer rank 0's end of one in-memory kind."""

    rendezvous: Rendezvous

    def connect(self) -> int: ...

    def close(self) -> None: ...


class InMemoryPublisher:
    """The trainer side both in-memory kinds share: rank 0 announces the rendezvous and waits for the servers;
    the final policy is written as a directory; a resumed run hands the checkpoint's policy over first (the
    servers may have started from the initial weights)."""

    def __init__(self, source: PolicySource, sender: Callable[[], InMemorySender]) -> None:
        self.source = source
        self.sender = None
        if source.is_main:
            self.sender = sender()
            announce = announce_path(source.run_dir)
            atomic_write_text(announce, self.sender.rendezvous.model_dump_json() + "\n")
            logger.info("weights (%s): waiting for inference servers at %s", self.sender.rendezvous.kind, announce)
            self.sender.connect()

    def hand_off(self, version: int) -> None:
        """Send policy `version` (not the final one) to the servers; every rank calls it."""
        raise NotImplementedError

    def settle(self) -> None:
        """Return once every server serves what was handed off; WeightTransportError if one failed."""

    def publish(self, version: int) -> None:
        if version == self.source.final_version:
            self.settle()
            publish_final(self.source)
        else:
            self.hand_off(version)

    def resumed(self, version: int) -> None:
        if version:
            self.publish(version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            announce_path(self.source.run_dir).unlink(missing_ok=True)
