"""Prompt logprobs: the engine scores prompt tokens in prefill (chunked, preempted, n > 1, mixed batches) exactly as
`transformers` does; `/generate`'s `prompt_logprobs` and `/v1/completions`' echo return them in their formats."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import torch

from support.polling import wait_until
from tandem.inference.engine import Engine
from tandem.inference.outputs import Collector, PromptLogprobs
from tandem.models.logprobs import reference_token_logprobs, score_tokens, token_logprobs
from tandem.wire.protocol import GenerateResponse, SamplingParams

ATOL = 1e-5  # fp32 on both sides


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32).eval()


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """`[len(prompt) - 1, vocab]`: log_softmax of transformers' logits, row i predicting prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def assert_matches_hf(hf_model, prompt: list[int], scores: PromptLogprobs, top_n: int) -> None:
    assert scores.complete and len(scores.logprobs) == len(prompt) and scores.logprobs[0] is None
    assert scores.top[0] is None
    want = hf_logprobs(hf_model, prompt)
    got = torch.tensor(scores.logprobs[1:], dtype=torch.float64)
    picked = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].double()
    torch.testing.assert_close(got, picked, atol=ATOL, rtol=0)
    if not top_n:
        assert all(top is None for top in scores.top)
        return
    values, ids = want.topk(top_n, dim=-1)
    for position, top in enumerate(scores.top[1:]):
        assert [i for i, _ in top] == ids[position].tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values[position], atol=ATOL, rtol=0)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Collector]:
    """Submit every prompt at once (so they share steps) and wait for all."""
    return engine.collect(prompts, params, n, timeout=120)


def prompts_of(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in lengths]


def test_score_tokens_is_token_logprobs_with_the_top_n():
    """Chunked (5 rows a chunk over 13): the targets' logprobs are token_logprobs' bit for bit, the top-N are the
    plain log_softmax's, and a target that is its row's argmax has exactly the top value (lm-eval's is_greedy)."""
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(13, 16, generator=generator), torch.randn(50, 16, generator=generator)
    targets = torch.randint(0, 50, (13,), generator=generator)
    targets[:4] = (hidden[:4] @ weight.T).argmax(-1)
    scored = score_tokens(hidden, weight, targets, 3, chunk_size=5)
    assert torch.equal(scored.logprobs, token_logprobs(hidden, weight, targets, chunk_size=5).logprobs)
    reference = reference_token_logprobs(hidden, weight, targets)
    torch.testing.assert_close(scored.logprobs, reference.logprobs, atol=ATOL, rtol=0)
    values, ids = (hidden @ weight.T).log_softmax(-1).topk(3, dim=-1)
    assert torch.equal(scored.top_ids, ids)
    torch.testing.assert_close(scored.top_logprobs, values, atol=ATOL, rtol=0)
    assert torch.equal(scored.logprobs[:4], scored.top_logprobs[:4, 0])


def test_engine_prompt_logprobs_equal_transformers(make_engine, hf_model, monkeypatch):
    """Prompts split over several prefill steps; sampling (temperature, top-k) does not touch the prompt's scores,
    and a request that does not ask for them costs no scoring."""
    from tandem.inference import runner as runner_module

    scorings = []
    monkeypatch.setattr(runner_module, "score_tokens", lambda *a, **k: scorings.append(1) or score_tokens(*a, **k))
    engine = make_engine(max_prefill_tokens=24)
    prompts = prompts_of((1, 2, 17, 40, 61), engine.vocab_size)
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=3, seed=1, prompt_logprobs=3)
    plain = run(engine, [prompts[3]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert not scorings and plain.prompt_logprobs is None
    collectors = run(engine, prompts, params, n=2)
    assert scorings
    for prompt, collector in zip(prompts, collectors, strict=True):
        assert_matches_hf(hf_model, prompt, collector.prompt_logprobs, 3)
        assert all(len(sample.token_ids) == 3 for sample in collector.samples)


def test_prompt_logprobs_without_top_and_in_a_mixed_batch(make_engine, hf_model):
    """Rows of scored and unscored prompts packed in one step: each scored prompt gets its own rows."""
    engine = make_engine()
    prompts = prompts_of((9, 30, 5, 22), engine.vocab_size, seed=1)
    engine.pause().result()  # queue everything, so one step prefills all four
    done: list[Collector] = []
    threads = [
        threading.Thread(target=lambda p=p, q=q: done.extend(run(engine, [p], SamplingParams(max_tokens=2, **q))))
        for p, q in zip(prompts, [{"prompt_logprobs": 0}, {}, {"prompt_logprobs": 0}, {}], strict=True)
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: engine.gauges.waiting_requests == 4, message="four queued requests")
    engine.resume().result()
    for thread in threads:
        thread.join()
    scored = [c.prompt_logprobs for c in done if c.prompt_logprobs is not None]
    assert len(scored) == 2
    for scores in scored:
        prompt = next(p for p in prompts if len(p) == scores.length)
        assert_matches_hf(hf_model, prompt, scores, 0)


def test_preempted_prompts_are_scored_once_and_right(make_engine, hf_model):
    """A cache too small for the batch preempts sequences, part-way through their prompt or after: their prompts
    are prefilled again, and every prompt position is still scored exactly once."""
    engine = make_engine(block_size=4, kv_cache_blocks=40, max_prefill_tokens=16)
    prompts = prompts_of((40, 90, 70, 55, 33, 80), engine.vocab_size, seed=3)
    collectors = run(engine, prompts, SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=2))
    assert engine.stats().preemptions > 0
    for prompt, collector in zip(prompts, collectors, strict=True):
        assert_matches_hf(hf_model, prompt, collector.prompt_logprobs, 2)


def test_samples_fork_when_a_prefill_chunk_leaves_the_last_prompt_token(make_engine):
    """25 tokens in 24-token chunks: the last prompt token runs alone in the next step, which must still fork the
    request's n samples (it once decoded sample 0 only, and the request never finished)."""
    engine = make_engine(max_prefill_tokens=24)
    (samples,) = engine.generate(
        prompts_of((25,), engine.vocab_size), SamplingParams(max_tokens=2, seed=0), n=3, timeout=60
    )
    assert [len(sample.token_ids) for sample in samples] == [2, 2, 2]


def test_engine_refuses_more_prompt_logprobs_than_max_logprobs(make_engine):
    engine = make_engine(max_logprobs=4)
    with pytest.raises(ValueError, match="prompt_logprobs=5"):
        engine.submit([1, 2, 3], SamplingParams(prompt_logprobs=5), lambda update: None)


# --- HTTP ---


@pytest.fixture
def server(make_engine, serve):
    return serve(make_engine())


def test_generate_returns_prompt_logprobs(server, hf_model):
    prompts = prompts_of((12, 3), server.engine.vocab_size, seed=5)
    body = {"prompt_token_ids": prompts, "n": 2, "sampling": {"max_tokens": 2, "prompt_logprobs": 2}}
    response = GenerateResponse.model_validate_json(httpx.post(f"{server.url}/generate", json=body).content)
    for prompt, output in zip(prompts, response.outputs, strict=True):
        tops = [None if t is None else [tuple(pair) for pair in t] for t in output.prompt_top_logprobs]
        assert_matches_hf(hf_model, prompt, PromptLogprobs(len(prompt), 2, output.prompt_logprobs, tops), 2)
    plain = httpx.post(f"{server.url}/generate", json={"prompt_token_ids": prompts[0], "sampling": {"max_tokens": 1}})
    assert plain.json()["outputs"][0]["prompt_logprobs"] is None


def _echo_body(prompt, **fields):
    return {"model": "tiny", "prompt": prompt, "temperature": 0, "echo": True, "logprobs": 1, **fields}


def test_completions_echo_is_what_lm_eval_reads(server, tokenizer, hf_model):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1 (or 0), greedy."""
    prompt = tokenizer("the quick brown fox jumps over the lazy dog").input_ids
    want = hf_logprobs(hf_model, prompt)
    picked = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for max_tokens in (1, 0):
        response = httpx.post(f"{server.url}/v1/completions", json=_echo_body([prompt], max_tokens=max_tokens))
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        logprobs = choice["logprobs"]
        prompt_text = tokenizer.decode(prompt)
        assert choice["text"].startswith(prompt_text)
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        assert logprobs["tokens"][: len(prompt)] == [tokenizer.decode([t]) for t in prompt]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1 : len(prompt)]), picked, atol=ATOL, rtol=0)
        greedy = want.argmax(-1)
        for position, top in enumerate(logprobs["top_logprobs"][1 : len(prompt)]):
            ((token, value),) = top.items()
            assert token == tokenizer.decode([int(greedy[position])])
            assert value == pytest.approx(want[position].max().item(), abs=ATOL)
            # lm-eval's is_greedy: the token's logprob equals the top one exactly when it is the argmax
            assert (logprobs["token_logprobs"][position + 1] == value) == (prompt[position + 1] == greedy[position])
        offsets = logprobs["text_offset"]
        steps = zip(offsets, offsets[1:], logprobs["tokens"], strict=False)
        assert offsets[0] == 0 and all(b - a == len(token) for a, b, token in steps)
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == prompt_text and choice["finish_reason"] == "length"


def test_completions_echo_of_a_text_prompt_and_without_logprobs(server, tokenizer):
    prompt = "once upon a time"
    texts = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": [prompt, "a"], "echo": True, "max_tokens": 3, "n": 2}
    ).json()
    assert [c["index"] for c in texts["choices"]] == [0, 1, 2, 3]
    assert all(c["text"].startswith(prompt) for c in texts["choices"][:2]) and texts["choices"][0]["logprobs"] is None
    assert all(c["text"].startswith("a") for c in texts["choices"][2:])
    scored = httpx.post(f"{server.url}/v1/completions", json=_echo_body(prompt, max_tokens=2, logprobs=0)).json()
    (choice,) = scored["choices"]
    ids = tokenizer(prompt).input_ids
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 2 and choice["logprobs"]["top_logprobs"] is None
    completion_offsets = choice["logprobs"]["text_offset"][len(ids) :]
    assert completion_offsets[0] == len(prompt)


def test_streamed_echo_starts_with_the_scored_prompt(server, tokenizer):
    prompt = tokenizer("the lazy dog").input_ids
    body = _echo_body(prompt, max_tokens=4, stream=True, ignore_eos=True)
    whole = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=ATOL)
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def _noting_where(render, where: list[str]):
    """`render`, noting in `where` whether each call ran on an event loop's thread."""

    def run(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            where.append("on the loop")
        except RuntimeError:
            where.append("off the loop")
        return render(*args, **kwargs)

    return run


def test_echoed_prompt_logprobs_are_rendered_off_the_event_loop_once_per_prompt(server, tokenizer, monkeypatch):
    """Rendering them decodes every prompt token (and its top-N): on the loop, a long prompt would stall /health."""
    from tandem.inference import openai_api

    calls: list[str] = []
    monkeypatch.setattr(openai_api, "echo_logprobs", _noting_where(openai_api.echo_logprobs, calls))
    prompt = tokenizer("the lazy dog").input_ids
    for stream in (False, True):
        body = _echo_body(prompt, max_tokens=2, n=3, stream=stream)
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    assert calls == ["off the loop", "off the loop"]


def test_a_whole_response_s_logprobs_are_rendered_off_the_event_loop(server, tokenizer, monkeypatch):
    """Non-streamed, every choice's every token (and its top-N) is decoded at once: a worker thread's job."""
    from tandem.inference import openai_api

    where: list[str] = []
    for name in ("completion_logprobs", "chat_logprobs"):
        monkeypatch.setattr(openai_api, name, _noting_where(getattr(openai_api, name), where))
    body = {"model": "tiny", "max_tokens": 4, "n": 2, "temperature": 0}
    completion = {**body, "prompt": tokenizer("the lazy dog").input_ids, "logprobs": 2}
    chat = {**body, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=completion).status_code == 200
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 200
    assert where and set(where) == {"off the loop"}


def test_max_tokens_zero_needs_echo(server):
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]


def test_the_vllm_routes_refuse_prompt_logprobs_on_generate(monkeypatch, tmp_path):
    """vLLM's /generate does not return them yet: a clear 400, never a response that silently lacks them."""
    from types import SimpleNamespace

    from tandem.inference.vllm import routes

    settings = routes.RouteSettings(str(tmp_path), "tiny", str(tmp_path), None, True, str(tmp_path), 1 << 20)
    monkeypatch.setenv(routes.SETTINGS_ENV, settings.to_env())
    middleware = routes.TandemRoutes(app=None)

    async def app(scope, receive, send):
        config = SimpleNamespace(max_model_len=64, max_logprobs=5, get_vocab_size=lambda: 100)
        engine = SimpleNamespace(model_config=config)  # its limits only: nothing reaches vLLM's engine
        scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
        await middleware(scope, receive, send)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            body = {"prompt_token_ids": [1, 2, 3], "sampling": {"prompt_logprobs": 0}}
            return await client.post("/generate", json=body)

    response = asyncio.run(post())
    assert response.status_code == 400 and "prompt_logprobs" in response.json()["error"]["message"]
