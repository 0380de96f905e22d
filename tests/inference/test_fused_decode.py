"""The Triton decode step equals the module-by-module decode step: logits, cache writes, and engine tokens.

On CPU the kernels run under Triton's interpreter in fp32 (tests/conftest.py sets TRITON_INTERPRET before any
kernel is defined; the interpreter's bf16 is not the GPU's); on CUDA they run compiled, in fp32 and bf16.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the decode kernels need the triton package")

from tandem.inference.decode import decode_inputs, decode_step
from tandem.inference.fused_decode import fused_decode_step
from tandem.kernels.decode import arrival_counters, decode_attention, paged_decode_attention, qk_norm_rope_store
from tandem.models import KVCache, load_model
from tandem.wire.protocol import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4


def _random_step(args, rows: int, width: int, seed: int, dtype: torch.dtype):
    """A filled cache (random K/V everywhere) and decode inputs: distinct blocks per row, lengths up to width."""
    g = torch.Generator().manual_seed(seed)
    blocks = 1 + rows * width
    cache = KVCache(args.num_layers, blocks, BLOCK, args.num_kv_heads, args.head_dim, dtype, DEVICE)
    for tensor in cache.k + cache.v:
        tensor.copy_(torch.randn(tensor.shape, generator=g))
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    lengths = torch.randint(0, width * BLOCK, (rows,), generator=g).tolist()
    tables = [order[i * width : i * width + length // BLOCK + 1] for i, length in enumerate(lengths)]
    tokens = torch.randint(0, args.vocab_size, (rows,), generator=g).tolist()
    return cache, decode_inputs(tokens, lengths, tables, rows, width).to(DEVICE)


def _clone(cache: KVCache) -> KVCache:
    copy = KVCache(1, 1, cache.block_size, 1, 1, cache.k[0].dtype, DEVICE)
    copy.k, copy.v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    copy.num_blocks = cache.num_blocks
    return copy


ATTENTION = {
    "three-kernels": {"fused_attention": False},
    "one-kernel": {"fused_attention": True},
}


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("rows", [5, 1], ids=["batched", "one-row"])  # one row: the fused GEMVs (dense models)
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_fused_step_equals_the_module_step_fp32(arch, rows, attention, model_dir):
    model = load_model(model_dir(arch), dtype=torch.float32, device=DEVICE).eval()
    cache, inputs = _random_step(model.args, rows=rows, width=6, seed=1, dtype=torch.float32)
    reference = _clone(cache)
    with torch.no_grad():
        got = fused_decode_step(model, cache, inputs, **ATTENTION[attention])
        want = decode_step(model, reference, inputs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for fused, plain in zip(cache.k + cache.v, reference.k + reference.v, strict=True):  # same rows written
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3], ids=["one-program", "split-keys"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (8, 1)])
def test_paged_attention_equals_sdpa_over_gathered_keys(heads, kv_heads, splits):
    """GQA groups of 3 (padded rows), 1 and 8; keys spanning many blocks in shuffled block order; the key range
    in one program, or split over three whose partial softmaxes are combined (some splits past a row's keys)."""
    g = torch.Generator().manual_seed(0)
    dim, blocks, rows, width = 16, 120, 3, 40
    k_cache, v_cache = (torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(DEVICE) for _ in range(2))
    tables = torch.randperm(blocks, generator=g)[: rows * width].view(rows, width).to(DEVICE)
    lengths = torch.tensor([0, 17, width * BLOCK - 1], device=DEVICE)
    q = torch.randn(rows, heads, dim, generator=g).to(DEVICE)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale=0.3, splits=splits)
    for row, length in enumerate(lengths.tolist()):
        slots = (tables[row, :, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).flatten()[: length + 1]
        keys, values = (c.flatten(0, 1)[slots].transpose(0, 1) for c in (k_cache, v_cache))
        want = F.scaled_dot_product_attention(q[row, :, None], keys, values, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(got[row].view(heads, dim), want[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3], ids=["one-program", "split-keys"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-qk-norm"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (8, 1)])
def test_one_kernel_attention_equals_the_three(heads, kv_heads, qk_norm, splits):
    """`decode_attention` (rotation, cache write, attention and split combine in one kernel) against
    `qk_norm_rope_store` + `paged_decode_attention` (+ the combine kernel): the same output and the same cache
    rows written, twice over one set of arrival counters, which each launch leaves at zero. Lengths: the new
    key alone, mid-block, and the last slot of the table (the new key in the last split)."""
    g = torch.Generator().manual_seed(heads + kv_heads)
    dim, blocks, rows, width, eps = 16, 130, 3, 40, 1e-6
    k_cache, v_cache = (torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(DEVICE) for _ in range(2))
    tables = (1 + torch.randperm(blocks - 1, generator=g)[: rows * width]).view(rows, width).to(DEVICE)
    lengths = torch.tensor([0, 17, width * BLOCK - 1], device=DEVICE)
    write_index = tables.gather(1, (lengths // BLOCK)[:, None])[:, 0] * BLOCK + lengths % BLOCK
    angles = torch.rand(rows, dim // 2, generator=g).to(DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)
    norms = [(1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE) for _ in range(2)] if qk_norm else [None, None]
    arrivals = arrival_counters(rows, kv_heads, torch.device(DEVICE))
    for step in range(2):
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        q = qk_norm_rope_store(qkv, *norms, eps, cos, sin, want_k, want_v, write_index)
        want = paged_decode_attention(q, want_k, want_v, tables, lengths, scale=0.3, splits=splits)
        got = decode_attention(
            qkv, *norms, eps, cos, sin, k_cache, v_cache, write_index, tables, lengths, 0.3, splits, arrivals=arrivals
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
        torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)
        assert not arrivals.any(), "every launch leaves its arrival counters at zero"


def test_engine_with_fused_decode_gives_the_module_tokens(make_engine):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 30]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = make_engine(decode_kernels="torch", cuda_graphs=False, device=DEVICE, kv_cache_blocks=64)
    fused = make_engine(decode_kernels="triton", cuda_graphs=False, device=DEVICE, kv_cache_blocks=64)
    want, got = plain.generate(prompts, params), fused.generate(prompts, params)
    assert [s[0].token_ids for s in got] == [s[0].token_ids for s in want]
    torch.testing.assert_close([s[0].logprobs for s in got], [s[0].logprobs for s in want], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels and CUDA graphs need CUDA")
def test_fused_step_bf16_and_under_cuda_graphs(model_dir, make_engine):
    model = load_model(model_dir("qwen3"), dtype=torch.bfloat16, device="cuda").eval()
    cache, inputs = _random_step(model.args, rows=7, width=5, seed=2, dtype=torch.bfloat16)
    reference = _clone(cache)
    with torch.no_grad():
        got, want = fused_decode_step(model, cache, inputs), decode_step(model, reference, inputs)
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)  # bf16 rounding, reordered sums
    prompts, params = [[5, 6, 7], [20] * 30], SamplingParams(temperature=0, max_tokens=16)
    eager = make_engine(decode_kernels="torch", cuda_graphs=False, device="cuda", kv_cache_blocks=64)
    graphed = make_engine(decode_kernels="triton", cuda_graphs=True, device="cuda", kv_cache_blocks=64)
    assert [s[0].token_ids for s in graphed.generate(prompts, params)] == [
        s[0].token_ids for s in eager.generate(prompts, params)
    ]
    assert graphed.runner.decoder.captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels and CUDA graphs need CUDA")
@pytest.mark.parametrize("width", [5, 80])  # 20 keys: one program per KV head; 320: the keys split over programs
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("attention", list(ATTENTION))
def test_triton_step_bf16_eager_and_replayed(model_dir, attention, rows, width):
    """The Triton step (one row: the GEMV step, PDL launches on Hopper) against the module step, and its
    CUDA-graph replay against its eager run: same logits, same cache writes."""
    model = load_model(model_dir("qwen3"), dtype=torch.bfloat16, device="cuda").eval()
    cache, inputs = _random_step(model.args, rows=rows, width=width, seed=3, dtype=torch.bfloat16)
    module_cache, replay_cache = _clone(cache), _clone(cache)
    step = functools.partial(fused_decode_step, **ATTENTION[attention])
    with torch.no_grad():
        eager, want = step(model, cache, inputs), decode_step(model, module_cache, inputs)
        torch.testing.assert_close(eager.float(), want.float(), atol=0.05, rtol=0.02)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(model, _clone(cache), inputs)  # autotuning and compiling happen outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = step(model, replay_cache, inputs)
        graph.replay()
    torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
    for got, expected in zip(replay_cache.k + replay_cache.v, cache.k + cache.v, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
