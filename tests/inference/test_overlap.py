"""Overlapped decode steps (`overlap_steps`): a step launched on the previous step's tokens before the host has
read them gives the same tokens, logprobs, finish reasons and versions as steps that read every token first,
through lengths, stop tokens and strings, the context limit, mixed sampling, n > 1, preemption, a queue, and a
cancel, pause or stop while a step is in flight."""

from __future__ import annotations

import threading

import torch

from support.inference import random_prompts
from tandem.inference.engine import Engine
from tandem.inference.outputs import Collector
from tandem.wire.protocol import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: pinned copies, events, CUDA graphs


def _engine(make_engine, **overrides) -> Engine:
    sized = {"kv_cache_blocks": 256} if DEVICE == "cuda" else {}  # not 90% of the GPU per engine
    return make_engine(**{"device": DEVICE, **sized, **overrides})


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    return random_prompts(count, vocab, (3, 30), seed)


def _serve(engine: Engine, jobs: list[tuple[list[int], SamplingParams, int]]) -> list[list[tuple]]:
    """Submit every job at once; per job and sample: (token ids, logprobs, finish, stop reason, versions, text)."""
    collectors = [Collector(n) for _, _, n in jobs]
    done = [threading.Event() for _ in jobs]
    for (prompt, params, n), collector, event in zip(jobs, collectors, done, strict=True):

        def on_update(update, collector=collector, event=event):
            collector.add(update)
            if update.finished:
                event.set()

        engine.submit(prompt, params, on_update, n=n, detokenize=bool(params.stop))
    assert all(event.wait(120) for event in done), "every request finishes"
    return [
        [(s.token_ids, s.logprobs, s.finish_reason, s.stop_reason, s.versions, s.text) for s in c.samples]
        for c in collectors
    ]


def _assert_same(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    for job, (have, expected) in enumerate(zip(got, want, strict=True)):
        for sample, (a, b) in enumerate(zip(have, expected, strict=True)):
            where = f"job {job} sample {sample}"
            assert a[0] == b[0], f"{where}: tokens {a[0]} vs {b[0]}"
            torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-5, rtol=0, msg=where)
            assert a[2:] == b[2:], f"{where}: finish/stop/versions/text differ"


def test_overlapped_steps_give_what_reading_every_token_gives(make_engine):
    overlapped, plain = _engine(make_engine), _engine(make_engine, overlap_steps=False)
    vocab = plain.vocab_size
    prompts = _prompts(9, vocab, seed=11)
    probe = plain.generate([prompts[5]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0][0]
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    jobs = [
        (prompts[0], greedy.model_copy(update={"max_tokens": 1}), 1),
        (prompts[1], greedy.model_copy(update={"max_tokens": 2}), 1),
        (prompts[2], greedy.model_copy(update={"max_tokens": 17}), 1),
        (prompts[3], SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True), 1),
        (prompts[4], SamplingParams(temperature=0.8, max_tokens=9, seed=4, ignore_eos=True), 3),
        (prompts[5], greedy.model_copy(update={"max_tokens": 20, "stop_token_ids": [probe.token_ids[7]]}), 1),
        (prompts[6], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=6, ignore_eos=True), 1),
        (prompts[7], greedy.model_copy(update={"max_tokens": 15}), 2),
    ]
    want = _serve(plain, jobs)
    assert want[5][0][2:4] == ("stop", probe.token_ids[7]) and len(want[5][0][0]) == 8
    _assert_same(_serve(overlapped, jobs), want)
    assert overlapped.stats().overlapped_steps > 0 and plain.stats().overlapped_steps == 0
    text = overlapped.generate([prompts[8]], greedy.model_copy(update={"max_tokens": 24}), detokenize=True)[0][0].text
    stop = text[5:8]
    jobs = [(prompts[8], greedy.model_copy(update={"max_tokens": 24, "stop": [stop]}), 1)]
    _assert_same(_serve(overlapped, jobs), _serve(plain, jobs))


def test_overlapped_steps_at_the_context_limit_and_under_preemption(make_engine):
    prompts = _prompts(6, 500, seed=12)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    # no max_tokens: every sequence runs to the 48-token context
    short = [_engine(make_engine, seq_len=48, overlap_steps=on) for on in (True, False)]
    jobs = [(p, greedy, 1) for p in prompts]
    _assert_same(*[_serve(engine, jobs) for engine in short])
    assert short[0].stats().overlapped_steps > 0
    # room for about two sequences: most are preempted and recomputed
    tight = [_engine(make_engine, block_size=4, kv_cache_blocks=24, overlap_steps=on) for on in (True, False)]
    jobs = [(p, greedy.model_copy(update={"max_tokens": 20}), 1) for p in prompts]
    _assert_same(*[_serve(engine, jobs) for engine in tight])
    assert tight[0].stats().preemptions > 0 and tight[0].stats().overlapped_steps > 0
    # two at a time: requests queue, but a queue that cannot join the batch does not stop the overlap
    pairs = [_engine(make_engine, max_running=2, overlap_steps=on) for on in (True, False)]
    _assert_same(*[_serve(engine, jobs) for engine in pairs])
    stats = pairs[0].stats()
    assert stats.overlapped_steps > stats.steps / 2, f"{stats.overlapped_steps} of {stats.steps} steps overlapped"


def test_a_stop_found_while_the_next_step_is_in_flight_drops_that_step(make_engine):
    """Alone in the engine every step overlaps, so the step after a stop token (or stop string) is already
    running when the stop is read: its token must not reach the output."""
    overlapped, plain = _engine(make_engine), _engine(make_engine, overlap_steps=False)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in _prompts(20, plain.vocab_size, seed=13):
        ((full,),) = plain.generate([prompt], greedy, detokenize=True)
        fresh = [i for i, t in enumerate(full.token_ids) if i >= 4 and t not in full.token_ids[:i]]
        if fresh and len(full.text) > 12:
            break
    else:
        raise AssertionError("no prompt whose greedy reply has a new token after its fourth")
    stop_token = full.token_ids[fresh[0]]
    jobs = [
        [(prompt, greedy.model_copy(update={"stop_token_ids": [stop_token]}), 1)],
        [(prompt, greedy.model_copy(update={"stop": [full.text[8:11]]}), 1)],
    ]
    for job in jobs:
        before = overlapped.stats().overlapped_steps
        got, want = _serve(overlapped, job), _serve(plain, job)
        _assert_same(got, want)
        assert want[0][0][2] == "stop" and len(want[0][0][0]) < len(full.token_ids)
        assert overlapped.stats().overlapped_steps - before >= len(want[0][0][0]) - 2, (
            "every step but the first overlapped"
        )


def _stepped(model_dir, **overrides) -> Engine:
    """An engine whose thread never starts: commands run at once and the test calls `_step` itself."""
    from support.inference import engine_config
    from tandem.models import load_model

    path = model_dir("qwen3")
    engine = Engine(load_model(path, dtype=torch.float32, device="cpu"), engine_config(path, device="cpu", **overrides))
    engine._send = lambda command: command()
    return engine


def test_cancel_pause_and_stop_keep_the_tokens_of_the_step_in_flight(model_dir):
    """Driven step by step: after k steps a request has k tokens, overlapped or not, whether it is then
    cancelled, the engine paused, or stopped; an n = 3 request with a one-token prompt forks and finishes."""
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=7, ignore_eos=True)
    prompt = list(range(5, 17))
    for ending in ("cancel", "pause", "stop"):
        outputs = []
        for overlap in (True, False):
            engine = _stepped(model_dir, overlap_steps=overlap)
            collector = Collector(3)
            request_id = engine.submit(prompt, params, collector.add, n=3)
            with torch.inference_mode():
                for _ in range(5):
                    assert engine._step()
                assert (engine.runner.in_flight is not None) == overlap
                if ending == "cancel":
                    engine._abort(request_id)
                elif ending == "pause":
                    engine._pause()
                    engine._abort(request_id)  # what is recorded by now is what pausing kept
                else:
                    engine._stopping = True
                    engine._run()
            assert engine.runner.in_flight is None and collector.finished
            outputs.append([(s.token_ids, s.finish_reason) for s in collector.samples])
        assert outputs[0] == outputs[1], ending
        assert all(len(tokens) == 5 and finish == "abort" for tokens, finish in outputs[0]), ending
    engine = _stepped(model_dir)
    collector = Collector(3)
    engine.submit([9], SamplingParams(temperature=1.0, max_tokens=4, seed=1, ignore_eos=True), collector.add, n=3)
    with torch.inference_mode():
        for _ in range(20):
            engine._step() if engine.requests.live else None
    assert collector.finished and [len(s.token_ids) for s in collector.samples] == [4, 4, 4]


def test_penalised_and_biased_rows_give_what_reading_every_token_gives(make_engine):
    """Penalties need the last token on the host, so their rows never overlap; a logit bias alone does not change
    from step to step, so biased rows still do. Either way the outputs equal those of plain steps."""
    overlapped, plain = _engine(make_engine), _engine(make_engine, overlap_steps=False)
    prompts = _prompts(4, plain.vocab_size, seed=14)
    penalised = SamplingParams(
        temperature=0, frequency_penalty=1.0, presence_penalty=0.5, max_tokens=14, ignore_eos=True
    )
    biased = SamplingParams(temperature=0.9, logit_bias={7: 3.0, 9: -100}, seed=6, max_tokens=12, ignore_eos=True)
    jobs = [
        (prompts[0], penalised, 1),
        (prompts[1], SamplingParams(temperature=1.0, presence_penalty=1.2, seed=5, max_tokens=12, ignore_eos=True), 2),
        (prompts[2], biased, 1),
        (prompts[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 1),
    ]
    _assert_same(_serve(overlapped, jobs), _serve(plain, jobs))
    before = overlapped.stats().overlapped_steps
    _assert_same(_serve(overlapped, [jobs[2]]), _serve(plain, [jobs[2]]))
    assert overlapped.stats().overlapped_steps > before, "biased rows alone overlap"
    before = overlapped.stats().overlapped_steps
    _assert_same(_serve(overlapped, [jobs[0]]), _serve(plain, [jobs[0]]))
    assert overlapped.stats().overlapped_steps == before, "penalised rows never overlap"
