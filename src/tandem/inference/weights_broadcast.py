"""The inference server's end of the trainer's weight broadcast (`tandem.transport.broadcast`).

`POST /weights/broadcast/join` (admin) starts a thread that joins the group and then, for each policy the trainer
offers: checks its names and shapes against the served model (a different model is refused before anything is
touched), pauses the engine between two steps, receives every tensor straight into the model's parameters (in
place, so CUDA graphs stay valid), marks the new version through `Engine.swap_weights` (whose copies are then
no-ops), resumes, and acknowledges. `GET /weights/broadcast` reports the state, the version and any error; the
orchestrator follows it. A failure part-way leaves the engine paused (its weights are half-written) and the
state `failed` with the message.
"""

from __future__ import annotations

import logging
import threading

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.inference.engine import Engine
from tandem.transport.broadcast import JoinRequest, ReceiverStatus, WeightBroadcastError, WeightReceiver

logger = logging.getLogger(__name__)


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class BroadcastEndpoint:
    """The two routes and the receiving thread of one server."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state: str = "idle"
        self.error: str | None = None
        self.policies = 0
        self._thread: threading.Thread | None = None

    def status(self) -> ReceiverStatus:
        return ReceiverStatus(
            state=self.state, policy_version=self.engine.version, policies=self.policies, error=self.error
        )

    async def status_route(self, request: Request) -> Response:
        return Response(self.status().model_dump_json(), media_type="application/json")

    async def join_route(self, request: Request) -> Response:
        try:
            join = JoinRequest.model_validate_json(await request.body())
        except ValidationError as error:
            return _error(400, f"bad join request: {error.errors(include_url=False)[:3]}")
        if self._thread is not None and self._thread.is_alive():
            return _error(409, "this server has already joined a weight broadcast")
        self.state, self.error = "joining", None
        self._thread = threading.Thread(target=self._run, args=(join,), name="tandem-weights-broadcast", daemon=True)
        self._thread.start()
        return Response(self.status().model_dump_json(), status_code=202, media_type="application/json")

    def _run(self, join: JoinRequest) -> None:
        receiver = WeightReceiver(join)
        timeout = join.timeout_s
        try:
            receiver.connect()
            self.state = "connected"
            logger.info("joined the weight broadcast at %s:%d as rank %d", join.host, join.port, join.rank)
            targets = dict(self.engine.model.named_parameters())
            while (offer := receiver.next_offer(lambda: True)) is not None:
                problem = receiver.check(offer, targets)
                if problem is not None:
                    receiver.refuse(offer, problem)
                    raise WeightBroadcastError(problem)
                self.engine.pause().result(timeout)
                self.state = "receiving"
                receiver.receive(offer, targets)
                pause_s = self.engine.swap_weights(targets, offer.version).result(timeout)
                self.engine.resume().result(timeout)
                receiver.acknowledge(offer)
                self.policies += 1
                self.state = "connected"
                logger.info("received policy %d over the broadcast (swap %.3fs)", offer.version, pause_s)
            self.state = "stopped"
        except Exception as error:
            self.state, self.error = "failed", f"{type(error).__name__}: {error}"
            logger.error("weight broadcast: %s", self.error)
        finally:
            receiver.close()
