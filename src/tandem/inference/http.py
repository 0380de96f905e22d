"""HTTP plumbing shared by every tandem route: the built-in server (server.py), tandem's routes on a vLLM server
(vllm/routes.py) and the weight receiver (weights_receiver.py), so both engines read, check and refuse
a request the same way.

- **Errors.** A handler raises `HTTPError`; `answer` turns it into `{"error": {"message", "type", "param",
  "code"}}`. Code under `refusals()` may raise any ValueError instead (the engines' checks, the OpenAI
  conversions, a refused checkpoint): a 4xx that names the problem. Anything else is logged once, with its
  traceback, and answered 500. A client that disconnects before its body has arrived costs one log line (and a
  499 nobody reads); one that disconnects while its request runs (`unless_client_gone`) cancels the work.
- **Bodies.** At most `max_body_bytes` (413, before a byte is read when `Content-Length` already says so),
  parsed strictly into a pydantic model; a large body is parsed on a worker thread, so the event loop keeps
  answering `/health` and the other requests meanwhile. A route may also take msgpack (`/generate`, for the
  rollout path): a body sent as `Content-Type: application/msgpack` is decoded safely (`tandem.wire.codec`) and
  validated by the same model, and `encoded_response` answers in msgpack to a request whose `Accept` names
  it. Errors are always JSON. A streamed answer is server-sent events (`sse_response`) ending in `[DONE]`, or
  in an error event when the work fails part-way.
- **Admin routes** (`AdminGuard`): the bearer token when one is configured; a body must be declared JSON and an
  `Origin` header, when a browser sends one, must name this server. A page on another site (or a DNS-rebound
  name) therefore cannot reach them: the "simple" requests a browser sends cross-site without asking (a form,
  a `text/plain` fetch) are refused, and a JSON one needs a CORS preflight this server never grants.
- **Queue depth.** Every response carries `x-queue-depth`, the requests waiting in the engine
  (`with_queue_depth`); the eval client's concurrency control reads it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.config.inference import InferenceConfig
from tandem.inference.limits import RequestRefused
from tandem.net import is_loopback
from tandem.wire import codec

logger = logging.getLogger(__name__)

CLIENT_GONE = 499
DEFAULT_MAX_BODY_BYTES: int = InferenceConfig.model_fields["max_body_bytes"].default
OFF_LOOP_BYTES = 256 * 2**10
"""Bodies above this are parsed on a worker thread (a 25 MB one takes half a second; this one a few milliseconds)."""

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Endpoint = Callable[[Request], Awaitable[Response]]


class HTTPError(Exception):
    """A request refused with `status`; the message says what to change."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.kind, self.param)

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status)


class ClientGone(Exception):
    """The client disconnected while its request ran; the work was cancelled and the answer (a 499) goes nowhere."""


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """The one error body of every route (OpenAI's shape, plus the status as `code`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_message(error: ValidationError) -> str:
    """A validation error as `field: problem; ...` (the first few)."""
    parts = []
    for item in error.errors(include_url=False)[:6]:
        where = ".".join(str(part) for part in item["loc"])
        if item["type"] == "json_invalid":
            parts.append(f"invalid JSON: {item['msg']}")
        elif item["type"] == "extra_forbidden":
            parts.append(f"unknown field `{where}`")
        else:
            parts.append(f"{where or 'body'}: {item['msg']}")
    return "; ".join(parts)


async def answer(request: Request, handling: Awaitable[Response]) -> Response:
    """Await a handler's response; its refusals become error responses, and nothing escapes to the ASGI server
    (which would log a second traceback)."""
    try:
        return await handling
    except HTTPError as error:
        return error.response()
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    except ClientDisconnect:
        logger.info("%s %s: the client disconnected before sending its whole body", request.method, request.url.path)
        return Response(status_code=CLIENT_GONE)
    except Exception as error:
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(500, f"{type(error).__name__}: {error}", "server_error"), status_code=500)


@contextmanager
def refusals() -> Iterator[None]:
    """ValueErrors raised inside become the answer: a RequestRefused with its status and field, a pydantic
    ValidationError field by field, any other a 400 with its message."""
    try:
        yield
    except ValidationError as error:
        raise HTTPError(400, validation_message(error)) from None
    except RequestRefused as error:
        raise HTTPError(error.status, str(error), param=error.param) from None
    except ValueError as error:
        raise HTTPError(400, str(error)) from None


def endpoint(handler: Endpoint) -> Endpoint:
    """A Starlette endpoint that answers through `answer`."""

    async def run(request: Request) -> Response:
        return await answer(request, handler(request))

    return run


def _too_large(max_bytes: int) -> HTTPError:
    return HTTPError(
        413,
        f"the request body is larger than this server's limit of {max_bytes} bytes (`max_body_bytes`)",
        param="body",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _media_types(header: str) -> list[str]:
    """The media types a `Content-Type` or `Accept` header names, lower case, parameters dropped."""
    return [part.split(";")[0].strip().lower() for part in header.split(",")]


def sends_msgpack(request: Request) -> bool:
    return _media_types(request.headers.get("content-type", ""))[0] == codec.MEDIA_TYPE


def accepts_msgpack(request: Request) -> bool:
    return codec.MEDIA_TYPE in _media_types(request.headers.get("accept", ""))


async def parse(request: Request, model: type[M], max_bytes: int, *, msgpack: bool = False) -> M:
    """The body validated strictly as `model` (400 naming the field), off the event loop when it is large. With
    `msgpack`, a body sent as msgpack is decoded (400 saying what is malformed) and validated by `model` too."""
    body = await read_body(request, max_bytes)
    validate = partial(_validate_msgpack, model) if msgpack and sends_msgpack(request) else model.model_validate_json
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(validate, body)
        return validate(body)
    except ValidationError as error:
        raise HTTPError(400, validation_message(error)) from None
    except codec.MsgpackError as error:
        raise HTTPError(400, str(error), param="body") from None


def _validate_msgpack(model: type[M], body: bytes) -> M:
    return model.model_validate(codec.unpack(body))


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def encoded_response(request: Request, model: BaseModel, status: int = 200) -> Response:
    """`model` in msgpack when the request's `Accept` names it, else JSON."""
    if accepts_msgpack(request):
        body = codec.pack(model.model_dump())
        return Response(body, status_code=status, media_type=codec.MEDIA_TYPE)
    return json_response(model, status)


def sse(data: BaseModel | dict[str, Any]) -> str:
    """One server-sent event."""
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {text}\n\n"


def sse_response(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Each chunk as a server-sent event, then `[DONE]`; an HTTPError raised by `chunks` part-way ends the stream
    with its error event instead (the status line has gone out already). `chunks` is closed when the stream ends,
    the client's disconnect included, so it can cancel its work."""

    async def events() -> AsyncIterator[str]:
        async with aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield sse(chunk)
            except HTTPError as error:
                yield sse(error.body())
                return
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (answered 499) once the client disconnects first. Either way, and when the
    handler itself is cancelled (server shutdown), `work` is cancelled if it has not finished."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(client_gone(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        gone.cancel()
    if task not in done:
        raise ClientGone
    return task.result()


def check_model(name: str | None, served: str, *others: str) -> str:
    """The model a request asks for: `served` when it names none, else the one of `served` and `others` it names
    (a 404 for any other)."""
    if name is None or name == served or name in others:
        return name or served
    listed = ", ".join(f"`{n}`" for n in (served, *others))
    raise HTTPError(404, f"model `{name}` is not served here; this server serves {listed}", "not_found_error", "model")


def check_version_order(version: int, served: int, rollback: bool) -> None:
    """409 for a weight update to a policy version older than the served one, unless it says `rollback`: a
    stale or reordered update would otherwise replace newer weights. The same version again passes (a retry)."""
    if version < served and not rollback:
        raise HTTPError(
            409,
            f"policy version {version} is older than the served version {served}; "
            "versions never go backwards unless the update sets rollback",
            param="version",
        )


def _origin_is_this_server(origin: str, server: tuple[str, int] | None) -> bool:
    """Whether a browser's `Origin` names the address this connection arrived at (its loopback names included)."""
    if server is None:
        return False
    try:
        parts = urlsplit(origin)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return False
    host, own_port = server
    if parts.hostname is None or port != own_port:
        return False
    return parts.hostname == host or (is_loopback(host) and is_loopback(parts.hostname))


class AdminGuard:
    """Who may call an admin route (`/update_weights`, `/pause`, `/resume`, `/weights/join`)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def check(self, request: Request) -> None:
        if self.token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise HTTPError(401, "admin routes need `Authorization: Bearer <admin token>`", "authentication_error")
        origin = request.headers.get("origin")
        if origin is not None and not _origin_is_this_server(origin, request.scope.get("server")):
            raise HTTPError(
                403, f"admin routes refuse requests from other sites (Origin `{origin}`)", "permission_error"
            )
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        has_body = media or request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        if has_body and media != "application/json":
            raise HTTPError(415, "admin routes take JSON: send `Content-Type: application/json` (or no body)")

    def __call__(self, handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        """`handler`, called only once the request passes `check`."""

        async def guarded(request: Request, *args: Any) -> Response:
            self.check(request)
            return await handler(request, *args)

        return guarded


def with_queue_depth(send: Send, depth: Callable[[], int | None]) -> Send:
    """`send`, adding `x-queue-depth` (requests waiting in the engine, read as the response starts) to the
    response; none when `depth()` is None (an engine that cannot tell)."""

    async def with_header(message: Message) -> None:
        if message["type"] == "http.response.start" and (value := depth()) is not None:
            message["headers"] = [*message.get("headers", []), (codec.QUEUE_DEPTH_HEADER.encode(), str(value).encode())]
        await send(message)

    return with_header


class QueueDepthHeader:
    """An app with `x-queue-depth` on every HTTP response (`with_queue_depth`)."""

    def __init__(self, app: ASGIApp, depth: Callable[[], int]) -> None:
        self.app, self.depth = app, depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self.app(scope, receive, with_queue_depth(send, self.depth))
