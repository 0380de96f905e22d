"""`/generate` in msgpack: the same rollout as JSON, the same validation, malformed bodies refused with a 400 that
names the problem, the body-size limit, JSON clients unaffected, and the vLLM routes decoding the same way."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgpack
import numpy as np
import pytest
from starlette.requests import Request

from tandem.inference.http import encoded_response
from tandem.wire.codec import MEDIA_TYPE, pack, unpack
from tandem.wire.kept_ids import encode_kept_ids
from tandem.wire.protocol import GenerateResponse, PromptOutput, SampleOutput

MSGPACK_IN = {"content-type": MEDIA_TYPE}
MSGPACK_OUT = {"accept": MEDIA_TYPE}
SEEDED = {
    "prompt_token_ids": [[5, 6, 7], [8, 9]],
    "n": 3,
    "sampling": {"temperature": 1.0, "top_k": 5, "max_tokens": 6, "seed": 11, "top_logprobs": 2},
}


@pytest.fixture
def server(make_engine, serve):
    return serve(make_engine())


def _outputs(response: httpx.Response) -> list:
    assert response.status_code == 200, response.text
    media = response.headers["content-type"].split(";")[0]
    data = unpack(response.content) if media == MEDIA_TYPE else response.json()
    # JSON has no tuples: compare the (id, logprob) pairs as lists either way
    return json.loads(json.dumps(data["outputs"]))


def _same_rollout(got: list, expected: list) -> None:
    """Tokens, kept ids (`masks`), versions and finish reasons equal; logprobs equal to fp32 rounding, as two runs
    of one seeded request on CPU may batch differently (the wire itself is exact: test_the_msgpack_response_is_exact)."""
    assert len(got) == len(expected)
    for prompt, want in zip(got, expected, strict=True):
        assert prompt["prompt_token_count"] == want["prompt_token_count"]
        for sample, wanted in zip(prompt["samples"], want["samples"], strict=True):
            for key in ("token_ids", "masks", "versions", "finish_reason", "stop_reason"):
                assert sample[key] == wanted[key], key
            assert sample["logprobs"] == pytest.approx(wanted["logprobs"], abs=1e-5)
            assert [[t for t, _ in step] for step in sample["top_logprobs"]] == [
                [t for t, _ in step] for step in wanted["top_logprobs"]
            ]


def test_msgpack_in_and_out_gives_the_same_rollout_as_json(server):
    url = f"{server.url}/generate"
    as_json = httpx.post(url, json=SEEDED)
    as_msgpack = httpx.post(url, content=pack(SEEDED), headers={**MSGPACK_IN, **MSGPACK_OUT})
    assert as_json.headers["content-type"] == "application/json"
    assert as_msgpack.headers["content-type"] == MEDIA_TYPE
    expected = _outputs(as_json)
    samples = [s for prompt in expected for s in prompt["samples"]]
    assert len(samples) == 6 and all(s["masks"] and len(s["logprobs"]) == len(s["token_ids"]) for s in samples)
    _same_rollout(_outputs(as_msgpack), expected)
    mixed_in = httpx.post(url, content=pack(SEEDED), headers=MSGPACK_IN)
    assert mixed_in.headers["content-type"] == "application/json"
    _same_rollout(_outputs(mixed_in), expected)
    mixed_out = httpx.post(url, json=SEEDED, headers={"accept": f"application/json, {MEDIA_TYPE};q=0.9"})
    assert mixed_out.headers["content-type"] == MEDIA_TYPE
    _same_rollout(_outputs(mixed_out), expected)


def test_the_msgpack_response_is_exact():
    """Every fp32 logprob, id, encoded kept ids and (id, logprob) pair comes back from msgpack exactly as JSON
    carries it."""
    values = np.random.default_rng(0).standard_normal(64).astype(np.float32).tolist()
    sample = SampleOutput(
        token_ids=list(range(64)), logprobs=values, masks=[encode_kept_ids([1, 5], 100), None] * 32, versions=[3] * 64,
        finish_reason="length", top_logprobs=[[(7, v), (9, -v)] for v in values],
    )  # fmt: skip
    response = GenerateResponse(
        id="gen-1", model="tiny", policy_version=3, outputs=[PromptOutput(prompt_token_count=2, samples=[sample])]
    )

    def sent(accept: str):
        reply = encoded_response(Request({"type": "http", "headers": [(b"accept", accept.encode())]}), response)
        assert reply.media_type == accept
        return unpack(reply.body) if accept == MEDIA_TYPE else json.loads(reply.body)

    from_msgpack = sent(MEDIA_TYPE)
    assert from_msgpack == json.loads(json.dumps(from_msgpack)) == sent("application/json")
    assert GenerateResponse.model_validate(from_msgpack) == response
    assert [np.float32(v) for v in from_msgpack["outputs"][0]["samples"][0]["logprobs"]] == values


def test_a_msgpack_body_is_validated_as_json_is(server):
    url = f"{server.url}/generate"

    def both(body: dict) -> tuple[httpx.Response, httpx.Response]:
        return httpx.post(url, json=body), httpx.post(url, content=pack(body), headers={**MSGPACK_IN, **MSGPACK_OUT})

    for wrong in (
        {"prompt_token_ids": [5], "sampling": {"temperature": "0.5"}},  # strict types
        {"prompt_token_ids": [5], "sampling": {"temprature": 0.5}},  # unknown field
        {"prompt_token_ids": [5], "n": True},
        {"prompt_token_ids": [], "n": 1},
        {"prompt_token_ids": [5], "sampling": {"temperature": float("inf")}},  # JSON sends it as 1e400
        {"prompt_token_ids": [5], "sampling": {"logit_bias": {"1e3": 1.0}}},
    ):
        sent = json.dumps(wrong).replace("Infinity", "1e400")
        json_reply = httpx.post(url, content=sent, headers={"content-type": "application/json"})
        msgpack_reply = httpx.post(url, content=pack(wrong), headers=MSGPACK_IN)
        assert json_reply.status_code == msgpack_reply.status_code == 400, wrong
        assert msgpack_reply.json() == json_reply.json()  # errors are JSON, with the same message
    # a token-id map's keys are strings in both encodings, and read the same way
    biased = {"prompt_token_ids": [5], "sampling": {"temperature": 0, "max_tokens": 4, "logit_bias": {"42": 100.0}}}
    json_reply, msgpack_reply = both(biased)
    assert _outputs(json_reply)[0]["samples"][0]["token_ids"] == [42] * 4
    assert _outputs(msgpack_reply) == _outputs(json_reply)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (pack(SEEDED)[:-3], "truncated"),
        (pack(SEEDED) + b"\x00", "extra bytes"),
        (b"\xc1", "starts no msgpack value"),
        (b"", "empty"),
        (msgpack.packb({"prompt_token_ids": msgpack.ExtType(1, b"\x05")}), "extension types"),
        (msgpack.packb({"prompt_token_ids": [5], "sampling": {"logit_bias": {42: 1.0}}}), "map keys must be strings"),
        (b"\x81\xa1x\xa2\xff\xfe", "not valid UTF-8"),
        (b"\xdd\xff\xff\xff\xff", "larger than the whole body"),
        (b"\x91" * 5000 + b"\xc0", "nested too deeply"),
        (json.dumps(SEEDED).encode(), "extra bytes"),  # JSON labelled msgpack
    ],
)
def test_malformed_msgpack_is_a_400_naming_the_problem_and_the_server_carries_on(server, body, problem):
    reply = httpx.post(f"{server.url}/generate", content=body, headers=MSGPACK_IN)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "invalid msgpack body" in error["message"] and problem in error["message"], error
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert _outputs(httpx.post(f"{server.url}/generate", content=pack(SEEDED), headers=MSGPACK_IN))


def test_a_msgpack_body_over_the_limit_gets_413(make_engine, serve):
    server = serve(make_engine(), max_body_bytes=4096)
    big = pack({"prompt_token_ids": [300] * 3000})
    declared = httpx.post(f"{server.url}/generate", content=big, headers=MSGPACK_IN)
    assert declared.status_code == 413 and "max_body_bytes" in declared.json()["error"]["message"]
    chunked = httpx.post(
        f"{server.url}/generate", content=(big[i : i + 1024] for i in range(0, len(big), 1024)), headers=MSGPACK_IN
    )
    assert chunked.status_code == 413
    assert httpx.post(f"{server.url}/generate", content=pack(SEEDED), headers=MSGPACK_IN).status_code == 200


def test_other_routes_stay_json(server):
    """Only /generate reads msgpack: elsewhere a msgpack body is refused as the JSON it is not."""
    body = {"prompt": "hello", "max_tokens": 2}
    reply = httpx.post(f"{server.url}/v1/completions", content=pack(body), headers={**MSGPACK_IN, **MSGPACK_OUT})
    assert reply.status_code == 400 and "invalid JSON" in reply.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json=body, headers=MSGPACK_OUT)
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"


def test_the_vllm_generate_route_decodes_msgpack_the_same_way(monkeypatch, tmp_path):
    """The refusals that come before vLLM's engine is called: the engine itself needs the vllm extra."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    from tandem.inference.vllm.routes import SETTINGS_ENV, RouteSettings, TandemRoutes

    settings = RouteSettings(
        model_dir=str(tmp_path), model_name="tiny", weights_dir=str(tmp_path), admin_token=None,
        exact_replay=True, run_dir=str(tmp_path), max_body_bytes=1024,
    )  # fmt: skip
    monkeypatch.setenv(SETTINGS_ENV, settings.to_env())
    app = Starlette(middleware=[Middleware(TandemRoutes)])
    app.state.engine_client = object()  # never reached by these requests

    async def calls() -> None:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
            malformed = await http.post("/generate", content=pack(SEEDED) + b"\x00", headers=MSGPACK_IN)
            assert malformed.status_code == 400 and "extra bytes" in malformed.json()["error"]["message"]
            too_big = await http.post("/generate", content=pack({"prompt_token_ids": [300] * 1000}), headers=MSGPACK_IN)
            assert too_big.status_code == 413
            wrong_model = await http.post("/generate", content=pack({"prompt_token_ids": [5], "model": "gpt-9"}),
                                          headers=MSGPACK_IN)  # fmt: skip
            assert wrong_model.status_code == 404 and "not served here" in wrong_model.json()["error"]["message"]
            unknown = await http.post("/generate", content=pack({"prompt_token_ids": [5], "x": 1}), headers=MSGPACK_IN)
            assert unknown.status_code == 400 and "unknown field `x`" in unknown.json()["error"]["message"]

    asyncio.run(calls())
