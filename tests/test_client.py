"""The OpenAI-compatible client: which failures retry, how often, what each attempt reports."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tandem.client import OpenAIClient, RequestError
from tandem.config.eval import RetryConfig
from tandem.wire.codec import QUEUE_DEPTH_HEADER

FAST = {"backoff_s": 0.001, "max_backoff_s": 0.01}

COMPLETION = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "42"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 3},
}


class Script:
    """A mock transport answering with the given responses (or raising exceptions) in order, then 200s."""

    def __init__(self, *steps) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.steps.pop(0) if self.steps else 200
        if isinstance(step, Exception):
            raise step
        if step == "slow":
            await asyncio.sleep(1)
            step = 200
        return httpx.Response(
            step, json=COMPLETION if step == 200 else {"error": "no"}, headers={QUEUE_DEPTH_HEADER: "3"}
        )


def chat(script: Script, *, feedback: list | None = None, timeout_s: float = 5.0, **retries):
    async def go():
        client = OpenAIClient(
            "http://server/v1",
            api_key="secret",
            timeout_s=timeout_s,
            retries=RetryConfig(**{**FAST, **retries}),
            on_feedback=None if feedback is None else feedback.append,
            transport=httpx.MockTransport(script),
        )
        async with client:
            return await client.chat([{"role": "user", "content": "6 * 7?"}], model="m", max_tokens=5)

    return asyncio.run(go())


def test_chat_parses_choices_usage_and_sends_the_request():
    script = Script()
    completion = chat(script)
    assert completion.choices[0].message == {"role": "assistant", "content": "42"}
    assert completion.choices[0].finish_reason == "length"
    assert (completion.prompt_tokens, completion.completion_tokens, completion.attempts) == (7, 3, 1)
    request = script.requests[0]
    assert request.url == "http://server/v1/chat/completions"  # a base URL with or without /v1
    assert request.headers["authorization"] == "Bearer secret"
    assert b'"max_tokens":5' in request.content.replace(b" ", b"")


def test_5xx_is_retried_as_configured():
    script = Script(500, 502)
    assert chat(script, max_retries=3).attempts == 3
    script = Script(500, 500, 500, 500, 500)
    with pytest.raises(RequestError) as failure:
        chat(script, max_retries=2)
    assert failure.value.kind == "5xx" and failure.value.status == 500 and failure.value.attempts == 3
    assert len(script.requests) == 3


def test_only_the_named_failures_retry():
    with pytest.raises(RequestError) as failure:
        chat(Script(503), retry_on=["timeout"])
    assert failure.value.attempts == 1
    with pytest.raises(RequestError) as failure:
        chat(Script(400), max_retries=3)  # a bad request fails at once, whatever the rules
    assert failure.value.kind == "status" and failure.value.attempts == 1
    assert chat(Script(429, httpx.ConnectError("refused")), max_retries=2).attempts == 3


def test_timeouts_are_their_own_kind_and_retried():
    with pytest.raises(RequestError) as failure:
        chat(Script("slow", "slow"), timeout_s=0.05, max_retries=1)
    assert failure.value.kind == "timeout" and failure.value.attempts == 2
    assert chat(Script("slow"), timeout_s=0.05, max_retries=1).attempts == 2


def test_every_attempt_reports_load_feedback():
    feedback: list = []
    with pytest.raises(RequestError):
        chat(Script(503, httpx.ConnectError("refused"), 400), feedback=feedback, max_retries=5)
    assert [f.overload for f in feedback] == ["5xx", "connection"]  # the 400 says nothing about load
    feedback.clear()
    chat(Script(429), feedback=feedback)
    assert [(f.overload, f.queue_depth) for f in feedback] == [("429", None), (None, 3)]
    assert all(f.latency_s >= 0 for f in feedback)


def test_backoff_honours_retry_after_up_to_the_cap():
    client = OpenAIClient("http://server", retries=RetryConfig(backoff_s=0.1, backoff_factor=2, max_backoff_s=1.0))
    assert 0.05 <= client._backoff(0, None) <= 0.1
    assert 0.1 <= client._backoff(1, None) <= 0.2
    assert client._backoff(10, None) <= 1.0
    assert client._backoff(0, 0.5) == 0.5
    assert client._backoff(0, 60) == 1.0
