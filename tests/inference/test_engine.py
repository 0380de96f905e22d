"""The engine on CPU in fp32: parity with transformers and with the trainer's logprobs, batch invariance,
chunked prefill and preemption, n > 1 on one prefill, stops, pause / cancel, weight swaps, failures contained to
the request that caused them."""

from __future__ import annotations

import threading

import pytest
import torch

from support.inference import assert_greedy_agrees_up_to_ties, assert_on_policy, random_prompts, trainer_logprobs
from support.model_parity import hf_greedy
from support.polling import wait_until
from support.tiny_models import INIT_STD
from support.tolerance import K_REORDERED
from tandem.inference.decode import EagerDecoder, decode_inputs, decode_step
from tandem.inference.outputs import Collector, RequestUpdate
from tandem.inference.sampling import Sampler, SamplingBatch
from tandem.inference.weights import read_weights
from tandem.models import KVCache, load_model
from tandem.testing.tiny import TINY_ARCHITECTURES
from tandem.wire.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _prompts(count: int, vocab: int, lengths=(3, 21), seed: int = 0) -> list[list[int]]:
    return random_prompts(count, vocab, lengths, seed)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_greedy_matches_transformers_generate(arch, model_dir, make_engine):
    from transformers import AutoModelForCausalLM

    path = model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    engine = make_engine(arch)
    prompts = _prompts(4, engine.vocab_size)
    ours = engine.generate(prompts, GREEDY)
    for prompt, (sample,) in zip(prompts, ours, strict=True):
        assert sample.token_ids == hf_greedy(hf, prompt, 16)


def test_a_prompt_alone_and_in_a_batch_of_16_gives_the_same_greedy_tokens(make_engine):
    engine = make_engine()
    prompts = _prompts(16, engine.vocab_size, seed=1)
    batched = engine.generate(prompts, GREEDY)
    for prompt, (sample,) in zip(prompts, batched, strict=True):
        assert engine.generate([prompt], GREEDY)[0][0].token_ids == sample.token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, seed=0),
        SamplingParams(temperature=1.3, min_p=0.05, max_tokens=24, seed=1),
        SamplingParams(temperature=1.0, max_tokens=24, seed=2),
        SamplingParams(temperature=0, max_tokens=24),
    ],
    ids=["top-k+top-p", "min-p", "whole-vocab", "greedy"],
)
def test_logprobs_match_the_trainer_recomputation(params, model_dir, make_engine):
    """Teacher-forced forward of a separately loaded copy, same temperature and kept ids: mismatch KL < 1e-6."""
    engine = make_engine()
    trainer_model = load_model(model_dir("qwen3"), dtype=torch.float32)
    prompts = _prompts(3, engine.vocab_size, seed=2)
    results = engine.generate(prompts, params, n=2)
    temperature = params.temperature or 1.0
    diffs = []
    for prompt, samples in zip(prompts, results, strict=True):
        for sample in samples:
            kept = sample.encoded_kept_ids if params.truncates else None
            trainer = trainer_logprobs(trainer_model, prompt, sample.token_ids, temperature, kept)
            diffs.append(trainer - torch.tensor(sample.logprobs, dtype=torch.float64))
            if params.truncates:
                assert any(step is not None for step in sample.encoded_kept_ids)
    assert_on_policy(diffs)


def test_chunked_prefill_and_preemption_keep_greedy_outputs(make_engine):
    roomy = make_engine()
    prompts = _prompts(6, roomy.vocab_size, lengths=(40, 90), seed=3)
    params = SamplingParams(temperature=0, max_tokens=30)
    expected = roomy.generate(prompts, params)
    # 16-token prefill chunks; room for about one sequence at a time, so most get preempted and recomputed.
    tight = make_engine(block_size=4, kv_cache_blocks=40, max_prefill_tokens=16)
    got = tight.generate(prompts, params)
    assert tight.stats().preemptions > 0
    for want, have in zip(expected, got, strict=True):
        assert have[0].token_ids == want[0].token_ids
        torch.testing.assert_close(torch.tensor(have[0].logprobs), torch.tensor(want[0].logprobs), atol=1e-4, rtol=0)
    wait_until(lambda: tight.gauges.kv_blocks_used == 0, message="all blocks free")


def test_n_samples_share_one_prefill_and_are_reproducible(make_engine):
    engine = make_engine()
    prefilled = []
    prefill = engine.model.prefill

    def counting(ids, cache, batch):
        prefilled.append(ids.numel())
        return prefill(ids, cache, batch)

    engine.model.prefill = counting
    prompt = _prompts(1, engine.vocab_size, lengths=(37, 38))[0]
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    samples = engine.generate([prompt], params, n=4)[0]
    assert prefilled == [37]
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert all(
        s.logprobs[0] == pytest.approx(samples[0].logprobs[0])
        for s in samples
        if s.token_ids[0] == samples[0].token_ids[0]
    )
    assert [s.token_ids for s in engine.generate([prompt], params, n=4)[0]] == [s.token_ids for s in samples]
    assert engine.generate([prompt], params)[0][0].token_ids == samples[0].token_ids


def test_stop_strings_and_stop_token_ids(make_engine):
    engine = make_engine()
    prompt = _prompts(1, engine.vocab_size, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ((full,),) = engine.generate([prompt], params, detokenize=True)
    assert len(full.text) > 12
    stop = full.text[6:9]
    ((cut,),) = engine.generate([prompt], params.model_copy(update={"stop": [stop]}), detokenize=True)
    assert cut.text == full.text[: full.text.find(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    token = full.token_ids[5]
    ((cut,),) = engine.generate([prompt], params.model_copy(update={"stop_token_ids": [token]}))
    assert cut.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", token)


def _collecting(engine, prompt, params):
    updates: list[RequestUpdate] = []
    done = threading.Event()

    def on_update(update: RequestUpdate) -> None:
        updates.append(update)
        if update.finished:
            done.set()

    request_id = engine.submit(prompt, params, on_update, stream=True)
    return request_id, updates, done


def test_pause_holds_work_and_cancel_frees_the_cache(make_engine):
    engine = make_engine()
    engine.pause().result(timeout=10)
    request_id, updates, done = _collecting(engine, [5, 6, 7], SamplingParams(temperature=0, ignore_eos=True))
    assert not done.wait(0.2) and engine.stats().generated_tokens == 0
    engine.resume().result(timeout=10)
    wait_until(lambda: engine.stats().generated_tokens >= 5, message="tokens after resume")
    engine.cancel(request_id)
    assert done.wait(10)
    assert updates[-1].samples[-1].finish_reason == "abort"
    wait_until(lambda: engine.gauges.kv_blocks_used == 0 and engine.gauges.running == 0, message="freed cache")


def test_weights_swap_between_steps_and_tokens_record_their_version(make_engine, tiny_model_dir):
    other = tiny_model_dir("qwen3", initializer_range=INIT_STD, seed=1)
    engine = make_engine()
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    _, updates, done = _collecting(engine, prompt, params)
    wait_until(lambda: sum(len(s.token_ids) for u in updates for s in u.samples) >= 5, message="first tokens")
    assert engine.swap_weights(read_weights(other, engine.model), version=1).result(timeout=30) >= 0
    assert done.wait(30)
    versions = [v for u in updates for s in u.samples for v in s.versions]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    short = SamplingParams(temperature=0, max_tokens=12)
    assert (
        engine.generate([prompt], short)[0][0].token_ids
        == make_engine(path=other).generate([prompt], short)[0][0].token_ids
    )
    assert engine.generate([prompt], short)[0][0].versions == [1] * 12


def test_requests_the_engine_cannot_serve_are_refused(make_engine):
    engine = make_engine(kv_cache_blocks=8, block_size=4)
    cases = {
        "no tokens": ([], SamplingParams()),
        "must lie in": ([10**6], SamplingParams()),
        "leaves no room": ([3] * 256, SamplingParams()),
        "does not fit": ([3] * 200, SamplingParams(max_tokens=100)),
        "KV-cache blocks": ([3] * 10, SamplingParams(max_tokens=100)),
        "max_logprobs": ([3], SamplingParams(max_tokens=2, top_logprobs=50)),
    }
    for message, (prompt, params) in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.submit(prompt, params, lambda update: None)


def test_static_decode_step_equals_the_cache_batch_decode(model_dir):
    model = load_model(model_dir("qwen3"), dtype=torch.float32).eval()
    a = model.args
    prompts = _prompts(3, a.vocab_size, seed=5)
    tables = [[1, 2], [3, 4], [5, 6]]
    logits = []
    for static in (False, True):
        cache = KVCache(a.num_layers, 8, 16, a.num_kv_heads, a.head_dim)
        lengths = [len(p) for p in prompts]
        with torch.no_grad():
            model.prefill(torch.tensor([t for p in prompts for t in p]), cache, cache.batch(lengths, [0, 0, 0], tables))
            tokens = [p[-1] for p in prompts]
            if static:  # wider tables and two padding rows, as a CUDA-graph bucket would have
                logits.append(decode_step(model, cache, decode_inputs(tokens, lengths, tables, rows=5, width=4))[:3])
            else:
                logits.append(model.decode(torch.tensor(tokens), cache, cache.batch([1, 1, 1], lengths, tables)))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens(model_dir, make_engine):
    """`compile=True` traces the decode step (cache writes included) with dynamic shapes (~20 s of inductor): the
    eager tokens, but where two logits tie within fp32 rounding (inductor sums in another order)."""
    from support.inference import skip_without_inductor_toolchain

    prompts = _prompts(3, 512, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # all finish together: no batch of 1
    expected = make_engine().generate(prompts, params)
    with skip_without_inductor_toolchain():
        got = make_engine(compile=True).generate(prompts, params)
    model = load_model(model_dir("qwen3"), dtype=torch.float32).eval()
    tokens = [[s[0].token_ids for s in samples] for samples in (got, expected)]
    assert_greedy_agrees_up_to_ties(model, prompts, *tokens, k=K_REORDERED)


def test_a_compiled_step_never_sees_a_batch_of_one(model_dir, make_engine):
    """Size 1 would be a second, specialised compilation (one that writes the KV cache wrong on torch 2.11's CPU
    inductor): a compiled engine pads a lone row with a scratch row, and the row's logits are the unpadded ones."""
    assert make_engine(compile=True).runner.decoder.min_rows == 2
    model = load_model(model_dir("qwen3"), dtype=torch.float32).eval()
    a = model.args
    seen: list[int] = []

    def step(model, cache, inputs):
        seen.append(inputs.shape[0])
        return decode_step(model, cache, inputs)

    logits = []
    for decoder_options in ({}, {"step": step, "min_rows": 2}):
        cache = KVCache(a.num_layers, 8, 16, a.num_kv_heads, a.head_dim)
        prompt = _prompts(1, a.vocab_size, seed=7)[0]
        with torch.no_grad():
            model.prefill(torch.tensor(prompt), cache, cache.batch([len(prompt)], [0], [[1, 2]]))
            logits.append(EagerDecoder(model, cache, **decoder_options)([prompt[-1]], [len(prompt)], [[1, 2]]))
    assert seen == [2] and logits[1].shape == logits[0].shape == (1, a.vocab_size)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def test_greedy_agreement_allows_only_ties(model_dir, make_engine):
    """The check the compiled and graphed decodes pass: a row that parts from the eager tokens at a clear winner
    fails it, the same row parting where the top two logits are made equal passes."""
    prompts = _prompts(2, 512, seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [s[0].token_ids for s in make_engine().generate(prompts, params)]
    model = load_model(model_dir("qwen3"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + expected[0][:3]]))[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    parted = [expected[0][:3] + [runner_up] * 5, expected[1]]
    assert assert_greedy_agrees_up_to_ties(model, prompts, expected, expected, k=K_REORDERED) == 0
    with pytest.raises(AssertionError, match="row 0 parts at token 3 without a tie"):
        assert_greedy_agrees_up_to_ties(model, prompts, parted, expected, k=K_REORDERED)
    with torch.no_grad():  # the runner-up's logit raised to the winner's: a tie
        model.lm_head_weight[runner_up] = model.lm_head_weight[expected[0][3]]
    assert assert_greedy_agrees_up_to_ties(model, prompts, parted, expected, k=K_REORDERED) == 1


class _PoisonSampler(Sampler):
    """Fails every step that samples a row with seed POISON, as a request-specific bug on the engine thread would."""

    POISON = 666

    def _check(self, batch: SamplingBatch) -> None:
        if self.POISON in batch.seeds.tolist():
            raise RuntimeError("poisoned row")

    def __call__(self, logits, batch):
        self._check(batch)
        return super().__call__(logits, batch)

    def on_device(self, logits, batch):
        self._check(batch)
        return super().on_device(logits, batch)


def _submit_all(engine, jobs):
    """Submit (prompt, params, n) jobs while paused, so the first step has them all; returns their collectors
    once all have finished."""
    collectors = [Collector(n) for _, _, n in jobs]
    done = [threading.Event() for _ in jobs]
    engine.pause().result()
    for (prompt, params, n), collector, event in zip(jobs, collectors, done, strict=True):

        def on_update(update, collector=collector, event=event):
            collector.add(update)
            if update.finished:
                event.set()

        engine.submit(prompt, params, on_update, n=n)
    engine.resume()
    assert all(event.wait(120) for event in done), "every request finishes"
    return collectors


def test_a_poisoned_request_fails_alone_and_the_others_complete_unchanged(make_engine):
    """Poisoned requests among good ones, all in one batch: each poisoned one fails with the step's error; the
    good ones (sampled, greedy, n > 1, overlapped or not) finish with exactly the tokens of a clean run; the
    engine stays up however many poisoned requests come."""
    clean, engine = make_engine(), make_engine()
    engine.runner.sampler = _PoisonSampler()
    prompts = _prompts(8, engine.vocab_size, seed=21)
    good = [
        (prompts[0], SamplingParams(temperature=1.0, max_tokens=12, seed=1, ignore_eos=True), 1),
        (prompts[1], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), 1),
        (prompts[2], SamplingParams(temperature=0.8, top_k=7, max_tokens=10, seed=2, ignore_eos=True), 3),
        (prompts[3], SamplingParams(temperature=1.0, max_tokens=14, seed=3, ignore_eos=True), 2),
    ]
    poisoned = [(p, SamplingParams(temperature=1.0, max_tokens=8, seed=_PoisonSampler.POISON), 1) for p in prompts[4:]]
    want = _submit_all(clean, good)
    got = _submit_all(engine, good[:2] + poisoned[:2] + good[2:] + poisoned[2:])
    for index in (2, 3, 6, 7):
        assert got[index].error is not None and "poisoned row" in got[index].error
        assert all(s.finish_reason == "abort" for s in got[index].samples)
    for have, expected in zip(got[:2] + got[4:6], want, strict=True):
        assert have.error is None
        assert [s.token_ids for s in have.samples] == [s.token_ids for s in expected.samples]
        for a, b in zip(have.samples, expected.samples, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    for _ in range(5):  # one failing request after another: none of them ends the engine
        with pytest.raises(RuntimeError, match="poisoned row"):
            engine.generate([prompts[4]], poisoned[0][1])
    assert engine.alive
    assert engine.generate([prompts[0]], good[0][1])[0][0].token_ids == want[0].samples[0].token_ids
    wait_until(lambda: engine.gauges.kv_blocks_used == 0, message="all blocks free")


def test_a_step_that_fails_once_loses_no_request(make_engine):
    """A failure no request causes (here: one prefill raises) is retried: every request completes as it would."""
    clean, engine = make_engine(), make_engine()
    prefill, calls = engine.model.prefill, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:  # the first step: every request's prompt
            raise RuntimeError("boom")
        return prefill(*args)

    engine.model.prefill = flaky
    prompts = _prompts(3, engine.vocab_size, seed=22)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=4, ignore_eos=True)
    jobs = [(prompt, params, 2) for prompt in prompts]
    got, want = _submit_all(engine, jobs), _submit_all(clean, jobs)
    assert all(c.error is None for c in got)
    assert [[s.token_ids for s in c.samples] for c in got] == [[s.token_ids for s in c.samples] for c in want]
    assert len(calls) > 2 and engine.alive


def test_a_request_that_finished_in_a_failed_step_is_delivered_and_holds_up_nothing(make_engine):
    """The step fails after its only request finished (here: its first update raises): that request is delivered,
    is not put on probation (it has nothing left to run, so probation would wait for it forever) and the next
    request runs."""
    engine = make_engine()
    emit, calls = engine.requests.emit, []

    def flaky(request, error=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return emit(request, error)

    engine.requests.emit = flaky
    prompt = _prompts(1, engine.vocab_size, seed=23)[0]
    (first,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1), timeout=60)
    assert len(first) == 1 and len(first[0].token_ids) == 1
    (second,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), timeout=60)
    assert second[0].token_ids[:1] == first[0].token_ids and len(second[0].token_ids) == 3
    assert not engine.scheduler.probation and engine.alive


def test_n_samples_that_could_never_start_together_are_refused(make_engine):
    """A request is admitted only with blocks for its first prompt chunk and one per other sample free at once;
    one needing more than the cache has would wait at the head of the queue forever, with everything after it."""
    engine = make_engine(block_size=4, kv_cache_blocks=16)  # 14 usable blocks
    prompt, params = [5, 6, 7, 8, 9], SamplingParams(temperature=1.0, max_tokens=3, seed=0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"n=14 samples of this prompt need 15 KV-cache blocks"):
        engine.check(prompt, params, n=14)
    (samples,) = engine.generate([prompt], params, n=13, timeout=120)  # 2 + 12 blocks: just fits
    assert len(samples) == 13 and all(len(s.token_ids) == 3 for s in samples)


def test_an_engine_that_cannot_step_at_all_stops_and_says_why(make_engine):
    """When the engine fails even with no request (a broken device), the failure is not pinned on a request:
    the engine stops, every request fails with the reason, and `alive` (so /health) reports it."""
    engine = make_engine()

    def broken(*args):
        raise RuntimeError("device lost")

    engine.model.prefill = broken
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([[5, 6, 7]], GREEDY, timeout=60)
    wait_until(lambda: not engine.alive, message="the engine to stop")
    assert "device lost" in engine.error
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit([5], GREEDY, lambda update: None)
