"""The HTTP server in-process: the official openai client, /generate, bad input, admin routes, weight updates
mid-request, disconnects, and 64 concurrent clients."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from support.inference import SEQ_LEN
from support.polling import wait_until
from support.tiny_models import INIT_STD
from tandem.testing import write_tiny_model
from tandem.wire.kept_ids import decode_kept_ids
from tandem.wire.protocol import GenerateResponse, SamplingParams


@pytest.fixture
def server(make_engine, serve):
    return serve(make_engine())


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _greedy_text(server, ids: list[int], max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return server.engine.generate([ids], params, detokenize=True)[0][0].text


def test_openai_client_completions(server, tokenizer):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "the quick brown fox"
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    (choice,) = done.choices
    assert choice.text == _greedy_text(server, tokenizer(prompt).input_ids, 8)
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 8
    assert len(choice.logprobs.token_logprobs) == 8 and all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    several = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[2].text == several.choices[3].text == _greedy_text(server, [8, 9], 4)
    assert several.usage.prompt_tokens == 5 and several.usage.completion_tokens == 16


def test_openai_client_chat_and_streaming(server, tokenizer):
    client = _client(server)
    messages = [{"role": "user", "content": "hello there"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)).input_ids
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    assert reply.choices[0].message.content == _greedy_text(server, ids, 8)
    assert reply.usage.prompt_tokens == len(ids)
    assert [len(t.top_logprobs) for t in reply.choices[0].logprobs.content] == [3] * 8
    sampled = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**sampled)
    stream = client.chat.completions.create(**sampled, stream=True, stream_options={"include_usage": True})
    texts, usage = ["", ""], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_generate_returns_token_ids_logprobs_kept_ids_and_versions(server):
    body = {
        "prompt_token_ids": [[5, 6, 7, 8], [9, 10]],
        "n": 2,
        "sampling": {"temperature": 1.0, "top_k": 5, "max_tokens": 6, "seed": 11, "top_logprobs": 2},
    }
    response = GenerateResponse.model_validate_json(httpx.post(f"{server.url}/generate", json=body).content)
    assert response.policy_version == 0 and [o.prompt_token_count for o in response.outputs] == [4, 2]
    params = SamplingParams.model_validate(body["sampling"])
    direct = server.engine.generate(body["prompt_token_ids"], params, n=2)
    for output, samples in zip(response.outputs, direct, strict=True):
        assert len(output.samples) == 2
        for sample, record in zip(output.samples, samples, strict=True):
            assert sample.token_ids == record.token_ids
            assert sample.logprobs == pytest.approx(record.logprobs, abs=1e-5)  # batch composition: fp32 rounding
            assert sample.versions == [0] * len(sample.token_ids) and sample.finish_reason in ("stop", "length")
            for token, encoded, top in zip(sample.token_ids, sample.masks, sample.top_logprobs, strict=True):
                kept = decode_kept_ids(encoded)
                assert len(kept) == 5 and token in kept and {i for i, _ in top} <= set(kept)
    greedy = httpx.post(f"{server.url}/generate", json={"prompt_token_ids": [5, 6], "sampling": {"temperature": 0}})
    (sample,) = greedy.json()["outputs"][0]["samples"]
    assert sample["masks"] is None and sample["top_logprobs"] is None
    assert len(sample["token_ids"]) == SEQ_LEN - 2 or sample["finish_reason"] == "stop"


BAD_REQUESTS = [
    ("/generate", b"{not json", 400, "invalid JSON"),
    ("/generate", {"prompt_token_ids": "five"}, 400, "prompt_token_ids"),
    ("/generate", {"prompt_token_ids": [1, 2], "sampling": {"temperature": "hot"}}, 400, "temperature"),
    ("/generate", {"prompt_token_ids": [1, 2], "temprature": 1.0}, 400, "unknown field `temprature`"),
    ("/generate", {"prompt_token_ids": [1, 2], "sampling": {"topk": 3}}, 400, "unknown field `sampling.topk`"),
    ("/generate", {"prompt_token_ids": [[1, 2], []]}, 400, "a prompt has no tokens"),
    ("/generate", {"prompt_token_ids": [3] * SEQ_LEN}, 400, "leaves no room"),
    ("/generate", {"prompt_token_ids": [3] * 10, "sampling": {"max_tokens": SEQ_LEN}}, 400, "does not fit"),
    ("/generate", {"prompt_token_ids": [3], "model": "gpt-9"}, 404, "not served here"),
    ("/generate", {"prompt_token_ids": [3], "sampling": {"top_logprobs": 99}}, 400, "max_logprobs"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": SEQ_LEN}, 400, "does not fit"),
    ("/v1/completions", {"prompt": "hi", "presense_penalty": 0.5}, 400, "unknown field `presense_penalty`"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}, 400, "stop"),
    ("/update_weights", {"path": 5, "version": 1}, 400, "path"),
]


def test_bad_requests_get_a_4xx_with_a_message_and_the_server_stays_up(server):
    with httpx.Client(base_url=server.url) as http:
        for path, body, status, message in BAD_REQUESTS:
            sent = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
            assert sent.status_code == status, (path, body, sent.text)
            assert message in sent.json()["error"]["message"], (path, body, sent.text)
        assert http.get("/generate").status_code == 405
        assert http.get("/nothing-here").status_code == 404
        assert http.get("/health").json()["status"] == "ok"
        assert (
            http.post("/generate", json={"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3}}).status_code == 200
        )


def test_health_and_metrics(server):
    httpx.post(f"{server.url}/generate", json={"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 4}})
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["policy_version"] == 0
    assert health.headers["x-queue-depth"] == "0"
    metrics = {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if not line.startswith("#")
    }
    assert metrics["tandem_generated_tokens_total"] >= 1 and metrics["tandem_requests_finished_total"] >= 1
    for name in ("requests_running", "requests_waiting", "kv_cache_usage", "tokens_per_second", "policy_version"):
        assert f"tandem_{name}" in metrics


def test_admin_routes_need_the_bearer_token_when_one_is_set(make_engine, serve):
    server = serve(make_engine(), admin_token="s3cret")
    assert httpx.post(f"{server.url}/pause").status_code == 401
    assert httpx.post(f"{server.url}/pause", headers={"Authorization": "Bearer nope"}).status_code == 401
    paused = httpx.post(f"{server.url}/pause", headers={"Authorization": "Bearer s3cret"})
    assert paused.status_code == 200 and paused.json()["paused"] is True
    resumed = httpx.post(f"{server.url}/resume", headers={"Authorization": "Bearer s3cret"})
    assert resumed.json()["paused"] is False
    assert httpx.get(f"{server.url}/health").status_code == 200  # only admin routes are guarded


def test_update_weights_mid_request_records_versions_and_serves_the_new_model(make_engine, serve, model_dir, tmp_path):
    write_tiny_model(tmp_path / "policy-1", "qwen3", seed=1, initializer_range=INIT_STD)
    write_tiny_model(tmp_path / "a-llama", "llama", initializer_range=INIT_STD)
    engine = make_engine()
    server = serve(engine, weights_dir=tmp_path)
    update = f"{server.url}/update_weights"
    assert httpx.post(update, json={"path": str(model_dir("qwen3")), "version": 1}).status_code == 403
    assert httpx.post(update, json={"path": "../elsewhere", "version": 1}).status_code == 403
    assert httpx.post(update, json={"path": "missing", "version": 1}).status_code == 400
    refused = httpx.post(update, json={"path": "a-llama", "version": 1})
    assert refused.status_code == 400 and "different model" in refused.json()["error"]["message"]

    long = {"prompt_token_ids": [5, 6, 7], "sampling": {"temperature": 0, "max_tokens": 200, "ignore_eos": True}}
    result = {}
    worker = threading.Thread(target=lambda: result.update(httpx.post(f"{server.url}/generate", json=long).json()))
    worker.start()
    wait_until(lambda: engine.stats().generated_tokens >= 5, message="the first tokens")
    swapped = httpx.post(update, json={"path": str(tmp_path / "policy-1"), "version": 1}, timeout=30)
    assert swapped.status_code == 200 and swapped.json()["policy_version"] == 1
    worker.join(30)
    versions = result["outputs"][0]["samples"][0]["versions"]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert result["policy_version"] == 1 and httpx.get(f"{server.url}/health").json()["policy_version"] == 1
    short = {"prompt_token_ids": [5, 6, 7], "sampling": {"temperature": 0, "max_tokens": 12}}
    after = httpx.post(f"{server.url}/generate", json=short).json()["outputs"][0]["samples"][0]["token_ids"]
    fresh = make_engine(path=tmp_path / "policy-1").generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))
    assert after == fresh[0][0].token_ids


def test_a_client_that_disconnects_cancels_its_request_and_frees_its_cache(make_engine, serve):
    engine = make_engine(seq_len=2048)
    server = serve(engine)
    endless = {"prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 2000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=endless, timeout=0.5)
    wait_until(lambda: engine.stats().requests_aborted == 1, message="the abort")
    wait_until(lambda: engine.gauges.kv_blocks_used == 0 and engine.gauges.running == 0, message="freed cache")
    streaming = {"prompt": "the quick", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=streaming) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    wait_until(lambda: engine.stats().requests_aborted == 2, message="the streaming abort")
    wait_until(lambda: engine.gauges.kv_blocks_used == 0, message="freed cache")
    assert engine.stats().generated_tokens < 2 * 2000


def test_64_concurrent_clients_all_complete_with_correct_results(make_engine, serve):
    engine = make_engine(max_running=32)  # fewer run slots than clients: the rest queue
    server = serve(engine)
    prompts = [[5 + i % 50, 6 + i % 7, 7 + i, 9] for i in range(64)]
    params = {"temperature": 0, "max_tokens": 12}

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        reply = await http.post("/generate", json={"prompt_token_ids": prompt, "sampling": params})
        assert reply.status_code == 200, reply.text
        return reply.json()["outputs"][0]["samples"][0]["token_ids"]

    async def everyone() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    got = asyncio.run(everyone())
    expected = engine.generate(prompts, SamplingParams(**params))
    assert got == [samples[0].token_ids for samples in expected]
    assert json.loads(httpx.get(f"{server.url}/health").text)["status"] == "ok"
