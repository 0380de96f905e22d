"""The inference server's end of the trainer's in-memory weight hand-off (`tandem.transport.weights`: the
`broadcast` and `shared` kinds).

`POST /weights/join` (admin) starts a thread that joins the trainer's hand-off (forms the broadcast group, or
maps the trainer's shared buffer after validating its handle) and then, for each policy the trainer offers:
checks its names and shapes against the served model's weights (`weights.weight_targets`: with LoRA adapters,
only the adapters travel; a different model is refused before anything is touched), pauses the engine between
two steps, copies the policy into the model's parameters in place (so CUDA graphs stay valid) and marks the
new version through `Engine.swap_weights`, resumes, and acknowledges.
`GET /weights` reports the state, the version and any error; the orchestrator follows it. A failure part-way
leaves the engine paused (its weights may be half-written), the state `failed` with the message, and the same
message in the answer the trainer waits for.

A join makes this server connect to the address in its body, so the address is checked first: the host must be
a loopback address or one of the server's `broadcast_hosts` (the trainer's `weights.host` on another node), the
port in 1..65535 (`Rendezvous`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable

from starlette.requests import Request
from starlette.responses import Response

from tandem.inference.engine import Engine
from tandem.inference.http import HTTPError, json_response, parse
from tandem.inference.weights import weight_targets
from tandem.net import is_loopback
from tandem.transport.weights.broadcast import BroadcastReceiver
from tandem.transport.weights.control import JoinRequest, Offer, ReceiverStatus, WeightTransportError
from tandem.transport.weights.shared import SharedReceiver

logger = logging.getLogger(__name__)

JOIN_BODY_BYTES = 64 * 1024
RECEIVERS = {"broadcast": BroadcastReceiver, "shared": SharedReceiver}


class ReceiverEndpoint:
    """The two routes and the receiving thread of one server."""

    def __init__(self, engine: Engine, allowed_hosts: Iterable[str] = ()) -> None:
        self.engine = engine
        self.allowed_hosts = frozenset(allowed_hosts)
        """Hosts besides loopback a join may name."""
        self.state: str = "idle"
        self.error: str | None = None
        self.policies = 0
        self._thread: threading.Thread | None = None

    def status(self) -> ReceiverStatus:
        return ReceiverStatus(
            state=self.state, policy_version=self.engine.version, policies=self.policies, error=self.error
        )

    async def status_route(self, request: Request) -> Response:
        return json_response(self.status())

    async def join_route(self, request: Request) -> Response:
        join = await parse(request, JoinRequest, JOIN_BODY_BYTES)
        self._check_host(join.host)
        if self._thread is not None and self._thread.is_alive():
            raise HTTPError(409, "this server has already joined a weight hand-off")
        self.state, self.error = "joining", None
        self._thread = threading.Thread(target=self._run, args=(join,), name="tandem-weights-receiver", daemon=True)
        self._thread.start()
        return json_response(self.status(), 202)

    def _check_host(self, host: str) -> None:
        """403 unless `host` is one this server may connect to for a weight hand-off."""
        if is_loopback(host) or host in self.allowed_hosts:
            return
        allowed = ", ".join(sorted(self.allowed_hosts)) or "none configured"
        raise HTTPError(
            403,
            f"this server joins weight hand-offs only on loopback or its `broadcast_hosts` ({allowed}), "
            f"not at `{host}`",
            "permission_error",
            "host",
        )

    def _run(self, join: JoinRequest) -> None:
        receiver = RECEIVERS[join.kind](join)
        timeout = join.timeout_s
        offer: Offer | None = None
        try:
            receiver.connect()
            self.state = "connected"
            logger.info("joined the weight %s at %s:%d as rank %d", join.kind, join.host, join.port, join.rank)
            targets = weight_targets(self.engine.model)  # with LoRA: the adapters only
            while (offer := receiver.next_offer(lambda: True)) is not None:
                problem = receiver.check(offer, targets)
                if problem is not None:
                    receiver.control.answer("ready", offer, problem)
                    raise WeightTransportError(problem)
                self.engine.pause().result(timeout)
                self.state = "receiving"
                tensors = receiver.receive(offer, targets)
                pause_s = self.engine.swap_weights(tensors, offer.version).result(timeout)
                self.engine.resume().result(timeout)
                receiver.acknowledge(offer)
                self.policies += 1
                self.state = "connected"
                logger.info(
                    "received policy %d over the %s: %d tensors (swap %.3fs)",
                    offer.version,
                    join.kind,
                    len(offer.tensors),
                    pause_s,
                )
            self.state = "stopped"
        except Exception as error:
            self.state, self.error = "failed", f"{type(error).__name__}: {error}"
            logger.error("weight %s: %s", join.kind, self.error)
            if offer is not None and receiver.control.store is not None:
                with contextlib.suppress(RuntimeError):  # the trainer may be waiting for this answer
                    receiver.control.answer("done", offer, self.error)
        finally:
            receiver.close()
