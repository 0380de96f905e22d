"""The engine serving DeepSeek-V3 (MLA: a key-only latent cache) and GLM-4.5 MoE (partial rotary, qk-norm) in
fp32 on CPU: greedy tokens equal transformers' `generate` with prompts batched, prefilled in chunks, paged
through a cache small enough to preempt and decoded in overlapped steps; sampled logprobs equal the trainer's teacher-forced scoring; prompt
logprobs equal transformers'; a checkpoint of the same family swaps in. Both families take the module decode
step (`fused_decode_supported` declines them), which is what runs here."""

from __future__ import annotations

import httpx
import pytest
import torch

from support.inference import (
    assert_greedy_agrees_up_to_ties,
    assert_on_policy,
    engine_config,
    random_prompts,
    trainer_logprobs,
)
from support.model_parity import DEEPSEEK_V3, GLM4_MOE, hf_greedy, hf_load, write_servable_model
from support.polling import wait_until
from tandem.inference.cuda_graphs import GraphedDecoder
from tandem.inference.engine import Engine
from tandem.inference.fused_decode import fused_decode_supported
from tandem.inference.main import eos_token_ids
from tandem.inference.weights import read_weights
from tandem.models import Logprobs, load_model
from tandem.wire.protocol import GenerateResponse, SamplingParams

FAMILIES = {"deepseek_v3": DEEPSEEK_V3, "glm4_moe": GLM4_MOE}
PAGED = {"block_size": 4, "kv_cache_blocks": 40, "max_prefill_tokens": 16}
"""Blocks of 4 tokens, room for about two of these sequences at once, prompts prefilled 16 tokens a step."""


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    cache = {}

    def make(family: str, seed: int = 0):
        if (family, seed) not in cache:
            path = tmp_path_factory.mktemp(family)
            cache[family, seed] = write_servable_model(path, FAMILIES[family], seed)
        return cache[family, seed]

    return make


@pytest.fixture(scope="module")
def hf_reference(family_dir):
    cache = {}

    def load(family: str):
        if family not in cache:
            cache[family] = hf_load(family_dir(family))
        return cache[family]

    return load


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_paged_greedy_generation_matches_transformers(family, family_dir, hf_reference, make_engine):
    engine = make_engine(path=family_dir(family), **PAGED)
    assert fused_decode_supported(engine.model) is not None
    if family == "deepseek_v3":
        assert engine.runner.cache.v == [] and engine.runner.cache.k[0].shape[1:] == (4, 1, 20 + 8)
    prompts = random_prompts(6, engine.vocab_size, (3, 50), seed=0)
    params = SamplingParams(temperature=0, max_tokens=24)
    ours = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.overlapped_steps > 0  # decode steps launched on unread tokens too
    hf = hf_reference(family)
    for prompt, (sample,) in zip(prompts, ours, strict=True):
        assert sample.token_ids == hf_greedy(hf, prompt, 24)
    wait_until(lambda: engine.gauges.kv_blocks_used == 0, message="all blocks free")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=20, seed=0, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=1, ignore_eos=True),
    ],
    ids=["whole-vocab", "top-k+top-p"],
)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sampled_logprobs_match_the_trainer_scoring(family, params, family_dir, make_engine):
    """n = 2 samples of 3 prompts through the paged cache, scored again by a separately loaded model as the RL
    trainer does (teacher-forced, same temperature and kept ids): mismatch KL < 1e-6."""
    path = family_dir(family)
    engine = make_engine(path=path, **PAGED)
    trainer_model = load_model(path, dtype=torch.float32).eval()
    prompts = random_prompts(3, engine.vocab_size, (5, 40), seed=2)
    diffs = []
    for prompt, samples in zip(prompts, engine.generate(prompts, params, n=2), strict=True):
        for sample in samples:
            kept = sample.encoded_kept_ids if params.truncates else None
            trainer = trainer_logprobs(trainer_model, prompt, sample.token_ids, params.temperature, kept)
            diffs.append(trainer - torch.tensor(sample.logprobs).double())
    assert_on_policy(diffs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_returns_prompt_logprobs_equal_to_transformers(family, family_dir, hf_reference, make_engine, serve):
    """`/generate` with `prompt_logprobs`: prompts scored across chunked prefill steps as transformers scores them,
    and each sampled token's logprob as the trainer scores it."""
    path = family_dir(family)
    server = serve(make_engine(path=path, max_prefill_tokens=16))
    prompts = random_prompts(2, server.engine.vocab_size, (20, 45), seed=5)
    sampling = {"temperature": 1.0, "seed": 3, "max_tokens": 6, "ignore_eos": True, "prompt_logprobs": 2}
    body = {"prompt_token_ids": prompts, "sampling": sampling}
    response = GenerateResponse.model_validate_json(httpx.post(f"{server.url}/generate", json=body).content)
    hf, trainer_model = hf_reference(family), load_model(path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, response.outputs, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        picked = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), picked, atol=1e-5, rtol=0)
        top_ids = [[token for token, _ in top] for top in output.prompt_top_logprobs[1:]]
        assert top_ids == want.topk(2, dim=-1).indices.tolist()
        (sample,) = output.samples
        ids = torch.tensor(prompt + sample.token_ids)
        with torch.no_grad():
            scored = trainer_model(ids[None, :-1], head=Logprobs(ids[None, 1:])).logprobs[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(sample.logprobs), scored, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpoint_of_the_same_family_swaps_in(family, family_dir, make_engine):
    """The file hand-off of RL: every tensor (the correction biases and shared experts included) is read, checked
    against the served model and copied in place; the engine then generates what a fresh engine on it does."""
    engine, other = make_engine(path=family_dir(family)), family_dir(family, seed=1)
    tensors = read_weights(other, engine.model)
    assert any(name.endswith("e_score_correction_bias") for name in tensors)
    assert any(".shared_experts." in name for name in tensors)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = engine.generate([prompt], params)[0][0].token_ids
    assert engine.swap_weights(tensors, version=1).result(timeout=30) >= 0
    after = engine.generate([prompt], params)[0][0]
    assert after.versions == [1] * 12
    fresh = make_engine(path=other).generate([prompt], params)[0][0].token_ids
    assert after.token_ids == fresh != before


@pytest.mark.parametrize(("family", "reason"), [("deepseek_v3", "latent attention"), ("glm4_moe", "partial rotary")])
def test_the_triton_decode_step_is_refused_with_the_reason(family, reason, family_dir, make_engine):
    """Its kernels read a fused qkv_proj and a V cache with full rotary: asked for, the engine says why not."""
    with pytest.raises(ValueError, match=f"decode_kernels = triton: .*{reason}"):
        make_engine(path=family_dir(family), decode_kernels="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_graphs_give_the_eager_tokens(family, family_dir):
    """Decode replayed from CUDA graphs over the key-only (MLA) or partial-rotary cache, overlapped steps on:
    the eager engine's tokens. In bf16, where the MoE layers' grouped GEMMs capture (in fp32 they fall back to a
    per-expert loop that reads counts on the host, and every bucket would run eagerly). A graph's attention reads
    its bucket's padded key capacity, so where two logits tie within bf16 rounding the rows may part."""
    from transformers import AutoTokenizer

    path = family_dir(family)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = random_prompts(6, tok.vocab_size, (3, 50), seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        config = engine_config(
            path, device="cuda", cuda_graphs=graphs, model={"name": str(path), "dtype": "bfloat16"}, **PAGED
        )
        model = load_model(path, dtype=torch.bfloat16, device="cuda")
        engine = Engine(model, config, tokenizer=tok, eos_token_ids=eos_token_ids(path, tok)).start()
        try:
            results[graphs] = [samples[0].token_ids for samples in engine.generate(prompts, params)]
            if graphs:
                assert isinstance(engine.runner.decoder, GraphedDecoder) and engine.runner.decoder.captured
                assert engine.stats().overlapped_steps > 0
        finally:
            engine.stop()
    assert_greedy_agrees_up_to_ties(model.eval(), prompts, results[True], results[False], k=2)
