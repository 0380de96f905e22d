"""A deterministic OpenAI-compatible server for eval and dashboard tests, served on a loopback thread.

It answers `/v1/chat/completions` with `answer(messages)` (cut to `max_tokens` words, finish_reason "length"),
and can be told to sleep (`delay`), to fail the next requests with a status (`fail_next`), to fail every
request (`status_always`), to answer `/v1/models` with an error status (`models_status`), and to report a queue
depth header (`queue_depth`: a number, or a callable giving each response's), or to refuse a chat request with
a status and body of its own (`refuse(body)`: None serves it), or to answer with one tool call instead of text
(`call_tool(body)` gives its function's name and arguments; None answers text). A request with `stream: true`
(verifiers' eval client sends those) is answered with the same reply as server-sent chunks: the text, then the
finish reason, then the usage when `stream_options.include_usage` asks, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from support.servers import AppThread
from tandem.wire.codec import QUEUE_DEPTH_HEADER

Messages = list[dict[str, Any]]


def echo(messages: Messages) -> str:
    return str(messages[-1]["content"])


class FakeServer(AppThread):
    """Serving from construction until `stop()`; `requests` holds every chat request's body, in order."""

    model = "fake-model"

    def __init__(self, answer: Callable[[Messages], str] = echo) -> None:
        self.answer = answer
        self.delay: Callable[[Messages], float] = lambda messages: 0.0
        self.status_always: int | None = None
        self.queue_depth: int | Callable[[], int] | None = None
        self.models_status: int | None = None
        self.refuse: Callable[[dict[str, Any]], tuple[int, dict[str, Any]] | None] = lambda body: None
        self.call_tool: Callable[[dict[str, Any]], tuple[str, dict[str, Any]] | None] = lambda body: None
        self.requests: list[dict[str, Any]] = []
        self._failures: list[int] = []
        self._lock = threading.Lock()
        routes = [
            Route("/health", lambda request: Response("ok")),
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ]
        super().__init__(Starlette(routes=routes))

    def fail_next(self, count: int, status: int = 500) -> None:
        with self._lock:
            self._failures.extend([status] * count)

    async def _models(self, request: Request) -> Response:
        if self.models_status is not None:
            return JSONResponse({"error": {"message": "no model list here"}}, status_code=self.models_status)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        messages = body["messages"]
        with self._lock:
            self.requests.append(body)
            status = self._failures.pop(0) if self._failures else self.status_always
        await asyncio.sleep(self.delay(messages))
        if status is not None:
            return JSONResponse({"error": {"message": f"scripted {status}"}}, status_code=status)
        refusal = self.refuse(body)
        if refusal is not None:
            return JSONResponse(refusal[1], status_code=refusal[0])
        call = self.call_tool(body)
        words = self.answer(messages).split(" ") if call is None else []
        cut = len(words) > body.get("max_tokens", len(words))
        text = " ".join(words[: body["max_tokens"]] if cut else words)
        depth = self.queue_depth() if callable(self.queue_depth) else self.queue_depth
        headers = {} if depth is None else {QUEUE_DEPTH_HEADER: str(depth)}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if call is not None:
            function = {"name": call[0], "arguments": json.dumps(call[1])}
            message["tool_calls"] = [{"id": f"call-{len(self.requests)}", "type": "function", "function": function}]
        reply = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if call is not None else "length" if cut else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": sum(len(str(m["content"]).split()) for m in messages),
                "completion_tokens": len(text.split()),
                "total_tokens": 0,
            },
        }
        reply["usage"]["total_tokens"] = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_chunks(reply, usage), media_type="text/event-stream", headers=headers)
        return JSONResponse(reply, headers=headers)


def _chunks(reply: dict[str, Any], usage: bool) -> Iterator[str]:
    """`reply` as a chat completion stream: a content delta, the finish reason, the usage when asked, `[DONE]`."""
    (choice,) = reply["choices"]
    head = {"id": reply["id"], "object": "chat.completion.chunk", "created": 0, "model": reply["model"]}
    message = choice["message"]
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
    first = {"role": "assistant", "content": message["content"], **({"tool_calls": calls} if calls else {})}
    deltas = [
        {"index": 0, "delta": first, "finish_reason": None},
        {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]},
    ]
    for delta in deltas:
        yield f"data: {json.dumps({**head, 'choices': [delta]})}\n\n"
    if usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': reply['usage']})}\n\n"
    yield "data: [DONE]\n\n"
