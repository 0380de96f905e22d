"""Multi-step decode (K steps with the sampler on the device) gives exactly the one-step engine's samples."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.protocol import SamplingParams


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (count,), generator=g)]


def _count_calls(engine) -> list[int]:
    """Record the K of every multi-step decode the engine runs."""
    calls: list[int] = []
    many = engine.decoder.many

    def counted(*args, **kwargs):
        calls.append(args[4])
        return many(*args, **kwargs)

    engine.decoder.many = counted
    return calls


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=29),
        SamplingParams(temperature=1.0, max_tokens=29, seed=3),
        SamplingParams(temperature=0.7, max_tokens=29, seed=4, ignore_eos=True),
    ],
    ids=["greedy", "sampled", "sampled-no-eos"],
)
def test_many_steps_equal_single_steps_token_for_token(params, make_engine):
    single = make_engine(decode_steps=1)
    multi = make_engine(decode_steps=8)
    calls = _count_calls(multi)
    prompts = _prompts(6, single.vocab_size, seed=7)
    want = single.generate(prompts, params, n=2)
    got = multi.generate(prompts, params, n=2)
    assert calls and set(calls) == {8}, "the multi-step path never ran"
    for want_samples, got_samples in zip(want, got, strict=True):
        for a, b in zip(want_samples, got_samples, strict=True):
            assert b.token_ids == a.token_ids
            assert b.finish_reason == a.finish_reason
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_a_row_that_stops_part_way_drops_its_extra_tokens(make_engine):
    """Stop token ids end a row inside a K-step run; its tokens after the stop are never reported."""
    single = make_engine(decode_steps=1)
    prompt = _prompts(1, single.vocab_size, seed=9)[0]
    free = single.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0][0]
    stop = free.token_ids[10]
    cut = free.token_ids.index(stop)
    multi = make_engine(decode_steps=8)
    calls = _count_calls(multi)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    (sample,) = multi.generate([prompt], params)[0]
    assert calls
    assert sample.token_ids == free.token_ids[: cut + 1]
    assert sample.finish_reason == "stop"
    assert multi.stats().kv_blocks_used == 0


def test_truncated_sampling_and_short_budgets_take_single_steps(make_engine):
    engine = make_engine(decode_steps=8)
    calls = _count_calls(engine)
    prompts = _prompts(3, engine.vocab_size, seed=11)
    engine.generate(prompts, SamplingParams(temperature=1.0, top_k=5, max_tokens=20, seed=0))
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=7))
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, top_logprobs=2))
    assert calls == []
