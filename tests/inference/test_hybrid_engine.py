"""The engine serving a hybrid model, Qwen3-Next (Gated DeltaNet layers with a recurrent state beside gated full
attention), in fp32 on CPU: greedy tokens equal transformers' `generate` with prompts batched continuously,
prefilled in chunks, through a cache small enough to preempt (a preempted sequence is recomputed from token 0, its
state from zero) and decoded in overlapped steps; n > 1 forks copy the prompt's state; sampled logprobs equal the
trainer's teacher-forced scoring; prompt logprobs (the hidden-states path) equal transformers'."""

from __future__ import annotations

import pytest
import torch

from support.hybrid_models import NEMOTRON_H_MOE, QWEN3_5, QWEN3_NEXT, write_servable_hybrid
from support.inference import assert_on_policy, engine_config, random_prompts, trainer_logprobs
from support.model_parity import hf_greedy, hf_load
from support.polling import wait_until
from tandem.inference.cuda_graphs import GraphedDecoder
from tandem.inference.engine import Engine
from tandem.inference.fused_decode import fused_decode_supported
from tandem.inference.kv_budget import block_bytes, state_bytes
from tandem.inference.main import eos_token_ids
from tandem.models import KVCache, StateCache, load_model, model_args
from tandem.wire.protocol import SamplingParams

PAGED = {"block_size": 4, "kv_cache_blocks": 40, "max_prefill_tokens": 16, "max_running": 4}
"""Blocks of 4 tokens, room for about two of these sequences at once, prompts prefilled 16 tokens a step, at most
4 running (so state slots are reused)."""


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return write_servable_hybrid(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def hf_model(hybrid_dir):
    return hf_load(hybrid_dir)


@pytest.mark.parametrize(("cache", "preempts"), [({"max_running": 8}, False), (PAGED, True)], ids=["roomy", "paged"])
def test_greedy_generation_matches_transformers(cache, preempts, hybrid_dir, hf_model, make_engine):
    engine = make_engine(path=hybrid_dir, **cache)
    assert engine.runner.state is not None and engine.runner.state.num_slots == cache["max_running"] + 1
    assert fused_decode_supported(engine.model) is not None
    prompts = random_prompts(6, engine.vocab_size, (3, 50), seed=0)
    params = SamplingParams(temperature=0, max_tokens=24)
    ours = engine.generate(prompts, params)
    stats = engine.stats()
    assert (stats.preemptions > 0) == preempts and stats.overlapped_steps > 0
    for prompt, (sample,) in zip(prompts, ours, strict=True):
        assert sample.token_ids == hf_greedy(hf_model, prompt, 24)
    wait_until(lambda: engine.gauges.kv_blocks_used == 0, message="all blocks free")
    assert engine.scheduler.num_free_slots == cache["max_running"]


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h_moe"])
def test_other_hybrids_greedy_generation_matches_transformers(family, tmp_path, make_engine):
    """Qwen3.5's separately stored projections, and Nemotron-H's Mamba-2 and MoE blocks, served."""
    config = {"qwen3_5": QWEN3_5, "nemotron_h_moe": NEMOTRON_H_MOE}[family]
    path = write_servable_hybrid(tmp_path / family, config)
    engine = make_engine(path=path, **PAGED)
    prompts = random_prompts(4, engine.vocab_size, (3, 40), seed=1)
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    hf = hf_load(path)
    for prompt, (sample,) in zip(prompts, ours, strict=True):
        assert sample.token_ids == hf_greedy(hf, prompt, 16)


def test_greedy_forks_continue_from_the_prompt_state(hybrid_dir, hf_model, make_engine):
    """n = 3 greedy samples fork off one prefill (the state copied into each child's slot, the prompt ending
    mid-block): every sample is transformers' greedy continuation."""
    engine = make_engine(path=hybrid_dir, **{**PAGED, "kv_cache_blocks": 64, "max_running": 6})
    prompts = random_prompts(2, engine.vocab_size, (9, 30), seed=4)
    prompts = [p if len(p) % 4 else [*p, 5] for p in prompts]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16), n=3)
    for prompt, samples in zip(prompts, outputs, strict=True):
        want = hf_greedy(hf_model, prompt, 16)
        assert [s.token_ids for s in samples] == [want] * 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=20, seed=0, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=1, ignore_eos=True),
    ],
    ids=["whole-vocab", "top-k+top-p"],
)
def test_sampled_logprobs_match_the_trainer_scoring(params, hybrid_dir, make_engine):
    """n = 2 samples of 3 prompts (forked) through the paged cache, scored again by a separately loaded model as
    the RL trainer does (teacher-forced, same temperature and kept ids): mismatch KL < 1e-6."""
    engine = make_engine(path=hybrid_dir, **PAGED)
    trainer_model = load_model(hybrid_dir, dtype=torch.float32).eval()
    prompts = random_prompts(3, engine.vocab_size, (5, 40), seed=2)
    diffs = []
    for prompt, samples in zip(prompts, engine.generate(prompts, params, n=2), strict=True):
        assert samples[0].token_ids != samples[1].token_ids
        for sample in samples:
            kept = sample.encoded_kept_ids if params.truncates else None
            trainer = trainer_logprobs(trainer_model, prompt, sample.token_ids, params.temperature, kept)
            diffs.append(trainer - torch.tensor(sample.logprobs).double())
    assert_on_policy(diffs)


def test_prompt_logprobs_match_transformers(hybrid_dir, hf_model, make_engine):
    """Prompt logprobs come from `cached_hidden_states` over chunked prefill steps, the state carried across them."""
    engine = make_engine(path=hybrid_dir, max_prefill_tokens=16, max_running=4)
    prompts = random_prompts(2, engine.vocab_size, (20, 45), seed=5)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    for prompt, collector in zip(prompts, engine.collect(prompts, params), strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        picked = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = collector.prompt_logprobs.logprobs
        torch.testing.assert_close(torch.tensor(got[-len(prompt) + 1 :]), picked, atol=1e-5, rtol=0)


def test_state_is_counted_and_the_fused_step_is_refused(hybrid_dir, make_engine):
    args = model_args({**QWEN3_NEXT, "vocab_size": 256})
    state = StateCache.for_model(args, 5, torch.bfloat16)
    assert state.recurrent[0].dtype == torch.float32 and state.conv[0].dtype == torch.bfloat16
    held = sum(t.numel() * t.element_size() for store in (state.conv, state.recurrent) for t in store.values())
    assert state_bytes(args, 5, torch.bfloat16) == held > 0
    # K/V only for the attention layers (1 and 3): a block costs half of what four caching layers would
    cache = KVCache.for_model(args, num_blocks=6, block_size=4)
    assert cache.layers == args.kv_layers == (1, 3)
    assert [t.numel() > 0 for t in cache.k] == [t.numel() > 0 for t in cache.v] == [False, True, False, True]
    kv_per_token = 2 * args.num_kv_heads * args.head_dim * 4  # K and V, fp32
    assert block_bytes(args, 4, torch.float32) == 2 * 4 * kv_per_token
    assert "hybrid" in (fused_decode_supported(load_model(hybrid_dir)) or "")
    with pytest.raises(ValueError, match=r"decode_kernels = triton: recurrent-state layers \(a hybrid model"):
        make_engine(path=hybrid_dir, decode_kernels="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_tokens(hybrid_dir):
    """Decode replayed from CUDA graphs with the state slots as an input column: the eager engine's tokens. fp32,
    as the dense models' graph tests: in bf16 a graph's padded batch runs GEMMs of another shape, whose rounding
    turns a near-tie of this random model's greedy choice another way."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hybrid_dir)
    prompts = random_prompts(6, tok.vocab_size, (3, 50), seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        config = engine_config(
            hybrid_dir, device="cuda", cuda_graphs=graphs, model={"name": str(hybrid_dir), "dtype": "float32"}, **PAGED
        )
        model = load_model(hybrid_dir, dtype=torch.float32, device="cuda")
        engine = Engine(model, config, tokenizer=tok, eos_token_ids=eos_token_ids(hybrid_dir, tok)).start()
        try:
            results[graphs] = [samples[0].token_ids for samples in engine.generate(prompts, params)]
            if graphs:
                assert isinstance(engine.runner.decoder, GraphedDecoder)
        finally:
            engine.stop()
    assert results[True] == results[False]


def test_scheduler_state_slots_follow_admission_forks_and_preemption():
    """One slot per running sequence (slot 0 scratch): assigned at admission and at a fork, freed when it leaves;
    a request still to fork holds room for its samples, so the slots never run out."""
    from tandem.inference.scheduler import SCRATCH_SLOT, BlockAllocator, Request, Scheduler

    def request(prompt_len: int, n: int, name: str) -> Request:
        return Request(name, list(range(1, prompt_len + 1)), SamplingParams(), n, 0, 100, False, False, lambda u: None)

    scheduler = Scheduler(BlockAllocator(64), 4, max_running=3, max_prefill_tokens=8, state_slots=4)
    scheduler.add(request(20, n=3, name="forks"), None)  # prefilled over 3 steps, then 3 samples
    scheduler.add(request(5, n=1, name="other"), None)
    plan = scheduler.schedule()
    (parent, take), *_ = plan.prefill
    assert parent.slot != SCRATCH_SLOT and len(plan.prefill) == 1  # "other" waits: the forks' samples hold 3 places
    while parent.pending:
        parent.num_cached += take
        take = next((t for s, t in scheduler.schedule().prefill if s is parent), 0)
    children, _ = scheduler.fork(parent, None)
    slots = {seq.slot for seq in scheduler.running}
    assert len(children) == 2 and len(slots) == 3 and SCRATCH_SLOT not in slots and scheduler.num_free_slots == 0
    scheduler.preempt(children[-1])
    assert children[-1].slot == SCRATCH_SLOT and children[-1].num_cached == 0 and scheduler.num_free_slots == 1
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert scheduler.num_free_slots == 3
