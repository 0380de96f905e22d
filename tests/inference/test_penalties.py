"""Frequency and presence penalties and logit_bias (OpenAI's and vLLM's semantics): the sampler against the
distribution computed by hand in torch, the engine against a reference decoding loop over transformers, and the
server through the official openai client. Reported logprobs are those of the adjusted distribution sampled from."""

from __future__ import annotations

import openai
import pytest
import torch

from tandem.inference.sampling import Sampler, SamplingBatch
from tandem.wire.protocol import SamplingParams

VOCAB = 64


def _adjusted(logits: torch.Tensor, p: SamplingParams, generated: list[int]) -> torch.Tensor:
    """`l + bias - frequency_penalty * count - presence_penalty * (count > 0)`, the plain way."""
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[-1]).double()
    bias = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for token, value in p.logit_bias.items():
        bias[token] = value
    return logits.double() + bias - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()


def _build(params: list[SamplingParams], generated: list[list[int]] | None) -> SamplingBatch:
    rows = len(params)
    seeds = [p.seed or 0 for p in params]
    steps = [len(g) for g in generated] if generated else [0] * rows
    return SamplingBatch.build(params, seeds, [0] * rows, steps, torch.device("cpu"), generated)


def test_sampled_tokens_and_logprobs_follow_the_adjusted_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g) * 2
    generated = [[3, 3, 5, 9, 3], [], [7, 7, 1], [2, 4, 2, 60]]
    params = [
        SamplingParams(
            temperature=0, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={11: 3.0}, top_logprobs=3
        ),
        SamplingParams(temperature=0.8, presence_penalty=1.5, logit_bias={0: -100, 1: 5.5}, seed=1, top_logprobs=3),
        SamplingParams(temperature=1.3, frequency_penalty=-0.5, presence_penalty=2.0, seed=2, top_logprobs=3),
        SamplingParams(
            temperature=0.9, top_k=10, top_p=0.9, frequency_penalty=1.0, logit_bias={4: 2.0}, seed=3, top_logprobs=3
        ),
    ]
    batch = _build(params, generated)
    assert not batch.stays_on_device, "penalised rows need their tokens on the host"
    out = Sampler()(logits, batch)
    for row, p in enumerate(params):
        adjusted = _adjusted(logits[row], p, generated[row])
        z = adjusted / (p.temperature or 1.0)
        token = out.tokens[row]
        if p.greedy:
            assert token == int(adjusted.argmax())
        if p.truncates:
            order = z.argsort(descending=True)[: p.top_k]
            probs = z[order].softmax(-1)
            kept = order[: int((probs.cumsum(-1) - probs < p.top_p).sum())]
            assert sorted(out.kept_ids[row]) == sorted(kept.tolist())
            log_probs = torch.full_like(z, float("-inf"))
            log_probs[kept] = z[kept] - z[kept].logsumexp(-1)
        else:
            log_probs = z.log_softmax(-1)
        assert token in log_probs.isfinite().nonzero().flatten().tolist()
        assert out.logprobs[row] == pytest.approx(float(log_probs[token]), abs=1e-5)
        top = log_probs.topk(3)
        assert [i for i, _ in out.top[row]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in out.top[row]]), top.values.float(), atol=1e-5, rtol=0)


def test_draws_follow_the_penalised_distribution():
    """20,000 seeded draws of one penalised, biased row against the distribution computed by hand."""
    logits = torch.linspace(-2, 2, VOCAB)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))]
    history = [int(logits.argmax()), int(logits.argmax()), 5, 6, 6, 6]
    draws = 20_000
    params = [
        SamplingParams(
            temperature=0.9, frequency_penalty=0.6, presence_penalty=0.3, logit_bias={2: 1.5, 8: -100}, seed=s
        )
        for s in range(draws)
    ]
    out = Sampler()(logits.expand(draws, VOCAB).contiguous(), _build(params, [history] * draws))
    probs = (_adjusted(logits, params[0], history) / 0.9).softmax(-1)
    freq = torch.bincount(torch.tensor(out.tokens), minlength=VOCAB).double() / draws
    assert (freq - probs).abs().max() < 0.015
    assert freq[8] == 0, "a -100 bias bans the token"


def test_no_history_means_bias_only_and_bias_alone_stays_on_the_device():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0, frequency_penalty=2.0, logit_bias={9: 50.0}), SamplingParams(temperature=0)]
    out = Sampler()(logits, _build(params, None))
    assert out.tokens == [9, int(logits[1].argmax())]
    biased = _build([SamplingParams(temperature=1.0, logit_bias={9: 50.0}, seed=0)], None)
    assert biased.stays_on_device and biased.next_step().adjust is biased.adjust
    tokens, logprobs = Sampler().on_device(logits[:1], biased)
    assert int(tokens[0]) == 9 and float(logprobs[0]) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="penalties"):
        _build(params[:1], None).next_step()


def _reference(hf, prompt: list[int], sample, p: SamplingParams) -> None:
    """Replay a sample token by token: each logprob is the token's under the adjusted (tempered, truncated)
    distribution computed from transformers' logits; greedy samples also take its argmax."""
    ids = list(prompt)
    for step, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        z = _adjusted(logits, p, sample.token_ids[:step]) / (p.temperature or 1.0)
        if p.greedy:
            assert token == int(z.argmax()), f"step {step}"
        kept = z.topk(p.top_k).indices if p.truncates else torch.arange(z.shape[0])
        assert token in kept.tolist(), f"step {step}"
        assert logprob == pytest.approx(float(z[token] - z[kept].logsumexp(-1)), abs=1e-4), f"step {step}"
        ids.append(token)


@pytest.mark.slow
def test_engine_penalties_match_a_reference_decoding_loop(model_dir, make_engine):
    from transformers import AutoModelForCausalLM

    path = model_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    engine = make_engine()
    prompt = [5, 6, 7, 8, 9, 10]
    greedy = SamplingParams(
        temperature=0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={17: 2.0}, max_tokens=14, ignore_eos=True
    )
    sampled = SamplingParams(
        temperature=0.9, top_k=8, presence_penalty=-1.0, frequency_penalty=0.8, max_tokens=10, seed=4, ignore_eos=True
    )
    plain = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))[0][0]
    (penalised,) = engine.generate([prompt], greedy)[0]
    assert penalised.token_ids != plain.token_ids, "the penalties change this greedy completion"
    _reference(hf, prompt, penalised, greedy)
    for sample in engine.generate([prompt], sampled, n=2)[0]:  # each sample counts its own tokens
        _reference(hf, prompt, sample, sampled)


def test_penalties_and_logit_bias_through_the_openai_client(make_engine, serve):
    server = serve(make_engine())
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    prompt = [5, 6, 7, 8, 9, 10]
    greedy = {"temperature": 0, "max_tokens": 12, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    params = SamplingParams(
        temperature=0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={17: 2.0}, max_tokens=12, ignore_eos=True
    )
    (want,) = server.engine.generate([prompt], params)[0]
    done = client.completions.create(
        model="tiny",
        prompt=prompt,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logit_bias={"17": 2.0},
        logprobs=0,
        **greedy,
    )
    (choice,) = done.choices
    assert choice.token_ids == want.token_ids
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    forced = client.completions.create(model="tiny", prompt=prompt, logit_bias={"23": 100}, logprobs=0, **greedy)
    assert forced.choices[0].token_ids == [23] * 12
    assert all(lp > -1e-3 for lp in forced.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        presence_penalty=2.0,
        logit_bias={"23": 100},
        **greedy,
    )
    assert chat.choices[0].token_ids == [23] * 12, "a +100 bias outweighs the presence penalty"
