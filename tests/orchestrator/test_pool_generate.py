"""The inference pool's rollouts against the built-in server: msgpack both ways, the same completions as the JSON
route gives, and the rollout sampling settings (ignore_eos included) reaching the engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tandem.client import OpenAIClient
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import InferencePoolConfig, RolloutSamplingConfig
from tandem.inference.engine import Engine
from tandem.inference.server import InferenceServer
from tandem.models import load_model
from tandem.orchestrator.pool import InferencePool, to_completion
from tandem.orchestrator.rollouts import sampling_params
from tandem.wire.codec import MEDIA_TYPE, unpack
from tandem.wire.protocol import GenerateRequest, GenerateResponse, SamplingParams

PROMPT = [5, 6, 7, 8]


class Recording(httpx.AsyncBaseTransport):
    """The server's ASGI app as a transport, keeping each request it passes on."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.requests.append(request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def start(tiny_model_dir, tmp_path):
    """`start(eos_ids=None)` -> (pool, transport): a pool whose one client talks to a built-in server in-process."""
    from transformers import AutoTokenizer

    engines = []

    def make(eos_ids: set[int] | None = None) -> tuple[InferencePool, Recording]:
        path = tiny_model_dir("qwen3", initializer_range=0.1)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = InferenceConfig(model={"name": str(path), "dtype": "float32"}, seq_len=128, device="cpu")
        model = load_model(path, dtype=torch.float32, device="cpu")
        everything = set(range(model.args.vocab_size)) if eos_ids is None else eos_ids
        engine = Engine(model, config, tokenizer=tokenizer, eos_token_ids=everything).start()
        engines.append(engine)
        server = InferenceServer(engine, tokenizer, "tiny", admin_token=None, weights_dir=tmp_path)
        transport = Recording(server.app())
        pool = InferencePool(InferencePoolConfig(base_urls=["http://127.0.0.1:8000"]))
        pool.clients = [OpenAIClient("http://127.0.0.1:8000", transport=transport)]
        return pool, transport

    yield make
    for engine in engines:
        engine.stop()


def test_the_pool_gets_the_json_routes_completions_over_msgpack(start):
    pool, transport = start(eos_ids=set())
    sampling = sampling_params(RolloutSamplingConfig(temperature=1.0, top_k=7), max_tokens=6, seed=3)

    async def both():
        try:
            completions = await pool.generate(PROMPT, sampling, n=4)
            request = GenerateRequest(
                prompt_token_ids=PROMPT, n=4, sampling=SamplingParams(top_k=7, max_tokens=6, seed=3)
            )
            reply = await pool.clients[0].request("POST", "/generate", request.model_dump(exclude_none=True))
            return completions, reply
        finally:
            await pool.close()

    completions, reply = asyncio.run(both())
    sent, answered = transport.requests
    assert sent.headers["content-type"] == sent.headers["accept"] == MEDIA_TYPE
    assert unpack(sent.content)["sampling"]["seed"] == 3
    assert answered.headers["content-type"] == "application/json"
    expected = [to_completion(s) for s in GenerateResponse.model_validate(reply.data).outputs[0].samples]
    assert len(completions) == 4 and all(c.kept_ids and len(c.token_ids) == 6 for c in completions)
    for got, want in zip(completions, expected, strict=True):
        assert (got.token_ids, got.versions, got.finish_reason, got.kept_ids) == (
            want.token_ids,
            want.versions,
            want.finish_reason,
            want.kept_ids,
        )
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)  # two runs may batch differently on CPU


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_pool_passes_ignore_eos_to_the_server(start, ignore_eos):
    """Every token is EOS here: a completion is one token long unless the pool says to ignore EOS."""
    pool, transport = start()
    sampling = sampling_params(RolloutSamplingConfig(ignore_eos=ignore_eos), max_tokens=5, seed=1)

    async def generate():
        try:
            return await pool.generate(PROMPT, sampling, n=2)
        finally:
            await pool.close()

    completions = asyncio.run(generate())
    assert unpack(transport.requests[0].content)["sampling"]["ignore_eos"] is ignore_eos
    expected = (5, "length") if ignore_eos else (1, "stop")
    assert [(len(c.token_ids), c.finish_reason) for c in completions] == [expected] * 2
