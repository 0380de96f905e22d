"""Every request is checked in full before anything is made for it: each numeric field has a range (a 400 that
names it), limits only the engine knows (context, max_running, vocabulary) are checked before anything is queued,
and no run of bad requests hurts the server: /health stays ok and good requests still complete. Also the
standard OpenAI fields clients send by default are accepted, and truly unknown ones still refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import ValidationError

from tandem.wire.protocol import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_SAMPLES,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
    context_room,
)


@pytest.fixture
def server(make_engine, serve):
    return serve(make_engine())


def _post(server, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=120)


def _generate(sampling: dict, **fields) -> dict:
    return {"prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 4, **sampling}, **fields}


# (route, body, words the 400's message must contain)
BAD_REQUESTS = [
    ("/generate", _generate({}, n=10**9), ["n"]),
    ("/generate", _generate({}, n=2**64), ["n"]),
    ("/generate", _generate({}, n=300), ["max_running"]),  # within the model's bound, above the engine's
    ("/generate", {**_generate({}, n=2), "prompt_token_ids": [[5]] * (MAX_SAMPLES // 2 + 1)}, ["samples"]),
    ("/generate", _generate({"top_k": 2**63}), ["top_k"]),
    ("/generate", _generate({"top_k": 2**70}), ["top_k"]),
    ("/generate", _generate({"temperature": 1e-45}), ["temperature", "greedy"]),
    ("/generate", _generate({"temperature": 1e-3}), ["temperature"]),
    ("/generate", _generate({"temperature": 1e400}), ["temperature"]),
    ("/generate", _generate({"max_tokens": 2**63}), ["max_tokens"]),
    ("/generate", _generate({"max_tokens": 10**6}), ["max_tokens", "does not fit"]),
    ("/generate", _generate({"seed": 2**64}), ["seed"]),
    ("/generate", _generate({"top_logprobs": 2**40}), ["top_logprobs"]),
    ("/generate", _generate({"top_logprobs": 21}), ["max_logprobs"]),
    ("/generate", _generate({"stop_token_ids": [-1]}), ["stop_token_ids"]),
    ("/generate", _generate({"stop_token_ids": [10**6]}), ["stop_token_ids"]),
    ("/generate", _generate({"frequency_penalty": 2.5}), ["frequency_penalty"]),
    ("/generate", _generate({"logit_bias": {"7": 101}}), ["logit_bias"]),
    ("/generate", _generate({"logit_bias": {"x": 1}}), ["logit_bias"]),
    ("/generate", _generate({"logit_bias": {"-1": 1}}), ["logit_bias"]),
    ("/generate", _generate({"logit_bias": {"1000000": 1}}), ["logit_bias"]),
    ("/generate", _generate({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}}), ["logit_bias"]),
    ("/v1/completions", {"prompt": [5], "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}}, ["bias"]),
    ("/generate", '{"prompt_token_ids": [5], "sampling": {"temperature": NaN}}', ["temperature"]),
    ("/generate", '{"prompt_token_ids": [5], "sampling": {"top_p": Infinity}}', ["top_p"]),
    ("/v1/completions", {"prompt": [5, 6], "n": 10**9}, ["n"]),
    ("/v1/completions", {"prompt": [5, 6], "top_k": 2**63}, ["top_k"]),
    ("/v1/completions", {"prompt": [5, 6], "temperature": 1e-45}, ["temperature"]),
    ("/v1/completions", {"prompt": [5, 6], "presence_penalty": -3}, ["presence_penalty"]),
    ("/v1/completions", {"prompt": [5, 6], "logprobs": 2**40}, ["logprobs"]),
    ("/v1/completions", {"prompt": [[5]] * (MAX_SAMPLES + 1)}, ["samples"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10**9}, ["n"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63}, ["top_k"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 5e-324}, ["temp"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1}, ["seed"]),
]


@pytest.mark.slow
def test_every_out_of_range_field_is_a_400_and_the_server_carries_on(server):
    good = _generate({"temperature": 1.0, "seed": 3})
    before = _post(server, "/generate", good)
    assert before.status_code == 200
    for _ in range(3):  # repeated: a bad request that reached the engine would fail a step (or run it out of memory)
        for path, body, words in BAD_REQUESTS:
            reply = _post(server, path, body)
            assert reply.status_code == 400, (path, body, reply.text)
            message = reply.json()["error"]["message"]
            assert all(word in message for word in words), (body, message)
        assert httpx.get(f"{server.url}/health").status_code == 200
    after = _post(server, "/generate", good)
    assert after.status_code == 200 and after.json()["outputs"] == before.json()["outputs"]
    assert server.engine.stats().requests_aborted == 0, "nothing bad reached the engine thread"


def test_the_smallest_temperatures_either_sample_sensibly_or_are_refused(server):
    ok = _post(server, "/generate", _generate({"temperature": 0.01, "seed": 1, "top_logprobs": 2}))
    assert ok.status_code == 200
    (sample,) = ok.json()["outputs"][0]["samples"]
    greedy = _post(server, "/generate", _generate({"temperature": 0}))
    assert sample["token_ids"] == greedy.json()["outputs"][0]["samples"][0]["token_ids"]  # T = 0.01: near-greedy
    assert all(-1e-3 < lp <= 0 for lp in sample["logprobs"])  # finite and valid, not NaN
    for tiny in (1e-45, 1e-30, 0.0099):
        with pytest.raises(ValidationError, match="greedy"):
            SamplingParams(temperature=tiny)


def test_request_models_bound_every_number():
    """The bounds live once in tandem.wire.protocol and hold for /generate and both OpenAI bodies alike."""
    for field, value in [("top_k", 2**63), ("temperature", 1e-45), ("frequency_penalty", 2.01), ("n", 10**9)]:
        for model, body in [
            (
                GenerateRequest,
                {"prompt_token_ids": [1], **({"n": value} if field == "n" else {"sampling": {field: value}})},
            ),
            (CompletionRequest, {"prompt": "x", field: value}),
            (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], field: value}),
        ]:
            with pytest.raises(ValidationError, match=field):
                model.model_validate_json(json.dumps(body))
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams.model_validate_json('{"logit_bias": {"5": -100, "7": 100}}').logit_bias == {5: -100, 7: 100}


def test_default_openai_fields_are_accepted_and_unknown_ones_refused(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    standard = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "seed": 1,
        "user": "someone",
    }
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        response_format={"type": "text"},
        store=False,
        parallel_tool_calls=True,
        **standard,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=4, **standard)
    assert done.choices[0].finish_reason in ("stop", "length")
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(openai.BadRequestError, match="response_format") as caught:
            client.chat.completions.create(model="tiny", messages=messages, response_format=response_format)
        assert "not supported" in str(caught.value) and response_format["type"] in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="unknown field `bogus`"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"bogus": 1})
    with pytest.raises(openai.BadRequestError, match="unknown field `store`"):  # chat-only fields stay chat's
        client.completions.create(model="tiny", prompt="hello", extra_body={"store": True})


def test_context_room_is_the_one_context_check():
    """Both engines (engine.check, the vLLM routes) refuse a prompt that leaves no room with these words."""
    assert context_room(10, None, 16) == 6
    assert context_room(10, 6, 16) == 6
    with pytest.raises(ValueError, match="the prompt has 16 tokens; the maximum context length is 16"):
        context_room(16, None, 16)
    with pytest.raises(ValueError, match=r"max_tokens=7 does not fit.*at most 6 tokens"):
        context_room(10, 7, 16)
