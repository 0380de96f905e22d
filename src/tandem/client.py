"""An async client for OpenAI-compatible servers: retries by rule, errors by kind, load feedback per attempt.

The orchestrator (training rollouts, online evals) and `tandem eval` both talk to inference servers through
it, so it sits below both packages. `request` takes any path (e.g. the token-in endpoint). Every attempt
that says something about the server's load (a success, or a timeout / connection error / 5xx / 429) is
reported as a `Feedback`, so a concurrency limiter (`tandem.eval.concurrency`) can follow the server. Bodies
are JSON; `request(..., msgpack=True)` sends and asks for msgpack instead (tandem's `/generate`), much
cheaper for big token and logprob lists, and decodes whichever of the two the server answered with.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from tandem.config.eval import RetryConfig
from tandem.wire import codec

logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO, drowning a run's log


RequestErrorKind = Literal["connection", "timeout", "5xx", "429", "status", "protocol"]
"""Why a request failed, after its retries (`RequestError.kind`)."""
OVERLOAD_KINDS = frozenset({"connection", "timeout", "5xx", "429"})
"""Failures that mean the server is struggling, as opposed to a bad request ("status") or a bad answer."""


@dataclass(frozen=True)
class Feedback:
    """What one request attempt says about the server's load."""

    started_at: float
    """`time.monotonic()` when the request was sent."""
    latency_s: float
    overload: str | None = None
    """Why the attempt counts as overload ("timeout", "connection", "5xx", "429"); None for a success."""
    queue_depth: int | None = None
    """Requests waiting on the server, when it reports it (shown, not acted on)."""


CONTEXT_FULL = re.compile(
    r"the context is \d+ \(seq_len\)"  # tandem's server, either engine (`wire.protocol.context_room`)
    r"|maximum context length is \d+"  # vLLM's OpenAI server (and OpenAI's API)
    r"|longer than the maximum model length",  # vLLM's input processor
    re.IGNORECASE,
)
"""How servers word a 400 for a request that does not fit the model's context (its prompt, or prompt plus
`max_tokens`)."""


class RequestError(Exception):
    """A request that failed for good, after any retries; `kind` says how."""

    def __init__(
        self,
        kind: RequestErrorKind,
        message: str,
        *,
        status: int | None = None,
        retry_after: float | None = None,
        server_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retry_after = retry_after
        self.server_message = server_message
        """The error body's own message (`error.message`, or vLLM's older top-level `message`), whole."""
        self.attempts = 1

    @property
    def context_full(self) -> bool:
        """Whether the server refused the request because it does not fit the model's context: a conversation
        that outgrew it, which a rollout ends as `truncated` (`tandem.envs.ContextFull`), not as an error."""
        return self.status == 400 and CONTEXT_FULL.search(self.server_message or "") is not None


@dataclass(frozen=True)
class Reply:
    """A successful response: its decoded body (JSON or msgpack) and what it took to get it."""

    data: Any
    latency_s: float
    """Seconds of the successful attempt."""
    attempts: int
    queue_depth: int | None = None


@dataclass(frozen=True)
class Choice:
    message: dict[str, Any]
    finish_reason: str | None


@dataclass(frozen=True)
class ChatCompletion:
    """One `/v1/chat/completions` response (token counts are 0 when the server reports no usage)."""

    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    attempts: int


def _server_root(base_url: str) -> str:
    """`http://host:port/v1` and `http://host:port` both name the server; paths below add `/v1` themselves."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


_MSGPACK_HEADERS = {"Content-Type": codec.MEDIA_TYPE, "Accept": codec.MEDIA_TYPE}


def _decoded(response: httpx.Response, method: str, path: str, msgpack: bool) -> Any:
    """The body: msgpack (decoded safely) when it was asked for and its `Content-Type` says so (a server that
    cannot answer msgpack answers JSON), else JSON; RequestError if it is not what it says."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if msgpack and media == codec.MEDIA_TYPE:
        try:
            return codec.unpack(response.content)
        except codec.MsgpackError as error:
            raise RequestError("protocol", f"{method} {path}: {error}") from None
    try:
        return response.json()
    except ValueError:
        raise RequestError("protocol", f"{method} {path}: response is not JSON: {response.text[:200]!r}") from None


def _error_message(response: httpx.Response) -> str | None:
    """The message of an error body: `{"error": {"message": ...}}` (OpenAI's shape: tandem's and vLLM's
    servers) or `{"message": ...}` (vLLM's older one); None for any other body."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    message = (
        error.get("message") if isinstance(error, dict) else body.get("message") if isinstance(body, dict) else None
    )
    return message if isinstance(message, str) else None


def _header_number(response: httpx.Response, name: str) -> float | None:
    try:
        return float(response.headers[name])
    except (KeyError, ValueError):
        return None


class OpenAIClient:
    """One connection pool to one server; every request retried by `retries`, bounded by `timeout_s`."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: RetryConfig | None = None,
        on_feedback: Callable[[Feedback], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.retries = retries or RetryConfig()
        self.on_feedback = on_feedback
        self.base_url = f"{_server_root(base_url)}/v1"
        """The server's OpenAI base URL, for a client of another library (verifiers') to reach it too."""
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=_server_root(base_url),
            headers=headers,
            timeout=None,  # asyncio.timeout bounds each whole attempt instead of each phase
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),  # the limiter bounds load
            transport=transport,
        )

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, msgpack: bool = False
    ) -> Reply:
        """Send one request, retrying the failures `retries.retry_on` names; raises RequestError. With `msgpack`,
        the body goes as msgpack and the response is asked for in msgpack (errors still come as JSON)."""
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                response = await self._attempt(method, path, body, msgpack)
                break
            except RequestError as error:
                if error.kind in OVERLOAD_KINDS:
                    self._report(Feedback(started, time.monotonic() - started, overload=error.kind))
                if attempt == self.retries.max_retries or error.kind not in self.retries.retry_on:
                    error.attempts = attempt + 1
                    raise
                await asyncio.sleep(self._backoff(attempt, error.retry_after))
                attempt += 1
        latency = time.monotonic() - started
        depth = _header_number(response, codec.QUEUE_DEPTH_HEADER)
        queue_depth = None if depth is None else int(depth)
        self._report(Feedback(started, latency, queue_depth=queue_depth))
        return Reply(_decoded(response, method, path, msgpack), latency, attempt + 1, queue_depth)

    async def _attempt(
        self, method: str, path: str, body: dict[str, Any] | None, msgpack: bool = False
    ) -> httpx.Response:
        try:
            async with asyncio.timeout(self.timeout_s):
                if msgpack:
                    content = None if body is None else codec.pack(body)
                    response = await self._http.request(method, path, content=content, headers=_MSGPACK_HEADERS)
                else:
                    response = await self._http.request(method, path, json=body)
        except TimeoutError:
            raise RequestError("timeout", f"{method} {path}: no response within {self.timeout_s:g}s") from None
        except httpx.TransportError as error:
            raise RequestError("connection", f"{method} {path}: {type(error).__name__}: {error}") from None
        if response.status_code < 400:
            return response
        status = response.status_code
        kind: RequestErrorKind = "429" if status == 429 else "5xx" if status >= 500 else "status"
        raise RequestError(
            kind,
            f"{method} {path}: HTTP {status}: {response.text[:200]}",
            status=status,
            retry_after=_header_number(response, "retry-after"),
            server_message=_error_message(response),
        )

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        policy = self.retries
        wait = min(policy.max_backoff_s, policy.backoff_s * policy.backoff_factor**attempt) * random.uniform(0.5, 1)
        return max(wait, min(retry_after or 0.0, policy.max_backoff_s))

    def _report(self, feedback: Feedback) -> None:
        if self.on_feedback is not None:
            self.on_feedback(feedback)

    async def models(self) -> list[str]:
        """Ids of the models the server serves (`GET /v1/models`)."""
        reply = await self.request("GET", "/v1/models")
        try:
            return [model["id"] for model in reply.data["data"]]
        except (KeyError, TypeError) as error:
            raise RequestError("protocol", f"GET /v1/models: unexpected body ({error!r})") from None

    async def chat(self, messages: list[dict[str, Any]], **fields: Any) -> ChatCompletion:
        """`POST /v1/chat/completions` with `messages` and any request fields (model, max_tokens, ...)."""
        reply = await self.request("POST", "/v1/chat/completions", {"messages": messages, **fields})
        try:
            choices = [Choice(c["message"], c.get("finish_reason")) for c in reply.data["choices"]]
        except (KeyError, TypeError) as error:
            raise RequestError("protocol", f"POST /v1/chat/completions: unexpected body ({error!r})") from None
        if not choices:
            raise RequestError("protocol", "POST /v1/chat/completions: no choices in the response")
        usage = reply.data.get("usage") or {}
        return ChatCompletion(
            choices=choices,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=reply.latency_s,
            attempts=reply.attempts,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
