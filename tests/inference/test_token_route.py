"""vLLM's token-in route, `/inference/v1/generate`, on the built-in server: the same tokens, logprobs and kept ids
as `/generate`, in the shape `renderers` parses, driven by `renderers`' own client; and its refusals."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.inference import SEQ_LEN
from tandem.wire.kept_ids import decode_kept_ids
from tandem.wire.protocol import GenerateResponse

ROUTE = "/inference/v1/generate"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def server(make_engine, serve):
    return serve(make_engine())


def _native(server, prompt: list[int], sampling: dict, n: int = 1) -> GenerateResponse:
    reply = httpx.post(f"{server.url}/generate", json={"prompt_token_ids": prompt, "sampling": sampling, "n": n})
    assert reply.status_code == 200, reply.text
    return GenerateResponse.model_validate(reply.json())


def _token_route(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{ROUTE}", json=body, timeout=60)


def test_greedy_tokens_and_logprobs_match_generate(server):
    native = _native(server, PROMPT, {"temperature": 0, "max_tokens": 6}).outputs[0].samples[0]
    reply = _token_route(
        server,
        {
            "model": "tiny",
            "token_ids": PROMPT,
            "request_id": "r-1",
            "sampling_params": {
                "temperature": 0,
                "max_tokens": 6,
                "logprobs": 1,
                "skip_special_tokens": False,
            },
            "cache_salt": "v0",
            "priority": 0,
        },
    )
    assert reply.status_code == 200, reply.text
    data = reply.json()
    (choice,) = data["choices"]
    assert data["request_id"] == "r-1" and data["prompt_token_ids"] == PROMPT
    assert choice["token_ids"] == native.token_ids and choice["finish_reason"] == native.finish_reason
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in native.token_ids]
    assert [entry["logprob"] for entry in content] == native.logprobs
    assert all(len(entry["top_logprobs"]) == 1 for entry in content)
    assert choice["sampling_mask"] is None  # greedy: nothing is ever cut
    assert choice["policy_versions"] == native.versions


def test_truncated_sampling_returns_each_tokens_kept_ids(server):
    sampling = {"temperature": 1.0, "top_k": 3, "seed": 11, "max_tokens": 5}
    native = _native(server, PROMPT, sampling, n=2).outputs[0].samples
    reply = _token_route(server, {"token_ids": PROMPT, "sampling_params": {**sampling, "n": 2, "logprobs": 0}})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, sample in zip(choices, native, strict=True):
        assert choice["token_ids"] == sample.token_ids
        assert choice["sampling_mask"] == [decode_kept_ids(kept) for kept in sample.masks]
        assert all(
            len(row) == 3 and token in row for row, token in zip(choice["sampling_mask"], sample.token_ids, strict=True)
        )
        assert all(entry["top_logprobs"] == [] for entry in choice["logprobs"]["content"])


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"token_ids": PROMPT, "sampling_params": {"best_of": 2}}, "best_of"),
        ({"token_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.1}}, "repetition_penalty"),
        ({"token_ids": PROMPT, "sampling_params": {"min_tokens": 3}}, "min_tokens"),
        ({"token_ids": PROMPT, "features": {"mm_hashes": {}}}, "content_parts"),
        ({"token_ids": PROMPT, "stream": True}, "stream"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [3] * SEQ_LEN}, "maximum context length"),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": SEQ_LEN}}, "max_tokens"),
        ({"token_ids": PROMPT, "model": "other"}, "other"),
    ],
)
def test_refusals_name_the_problem_and_the_server_carries_on(server, body, words):
    reply = _token_route(server, body)
    assert reply.status_code in (400, 404), reply.text
    assert words in reply.json()["error"]["message"], reply.text
    assert _token_route(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}).status_code == 200


def test_renderers_client_generates_through_the_route(server, tokenizer):
    """`renderers.client.generate` (what verifiers' train client and prime-rl call) renders a chat, posts it here
    and parses the reply: the engine's greedy tokens and logprobs come back, and a prompt longer than the context
    (read from `/v1/models`) is refused before it is sent."""
    renderers = pytest.importorskip("renderers")
    from openai import AsyncOpenAI
    from renderers.client import OverlongPromptError, generate

    renderer = renderers.create_renderer(tokenizer, renderers.DefaultRendererConfig())
    messages = [{"role": "user", "content": "what is two plus two?"}]
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    async def ask(content: str) -> dict:
        return await generate(
            client=client,
            renderer=renderer,
            messages=[{"role": "user", "content": content}],
            model="tiny",
            sampling_params={"temperature": 0, "max_tokens": 6},
        )

    result = asyncio.run(ask(messages[0]["content"]))
    prompt_ids = renderer.render(messages, add_generation_prompt=True).token_ids
    native = (
        _native(
            server,
            prompt_ids,
            {"temperature": 0, "max_tokens": 6, "stop_token_ids": list(renderer.get_stop_token_ids())},
        )
        .outputs[0]
        .samples[0]
    )
    assert result["prompt_ids"] == prompt_ids
    assert result["completion_ids"] == native.token_ids
    assert result["completion_logprobs"] == native.logprobs
    assert result["finish_reason"] == native.finish_reason
    with pytest.raises(OverlongPromptError):
        asyncio.run(ask("word " * SEQ_LEN))
