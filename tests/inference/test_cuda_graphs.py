"""Decode under CUDA graphs equals eager decode, alone and inside the engine (compiled too). Needs CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.cuda_graphs import GraphedDecoder, width_buckets
from tandem.inference.decode import EagerDecoder
from tandem.models import KVCache, load_model
from tandem.wire.protocol import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_width_buckets_double_up_to_the_context():
    assert width_buckets(16, 128) == [16, 32, 64, 128]
    assert width_buckets(16, 100) == [16, 32, 64, 100]
    assert width_buckets(512, 4) == [1, 2, 4]


def test_graph_replays_equal_eager_steps(model_dir):
    model = load_model(model_dir("qwen3"), dtype=torch.float32, device="cuda").eval()
    a = model.args
    cache = KVCache(a.num_layers, 64, 16, a.num_kv_heads, a.head_dim, device="cuda")
    graphed, eager = GraphedDecoder(model, cache, [1, 2, 4, 8], max_blocks=16), EagerDecoder(model, cache)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 8, 5):
        tables = [[1 + 4 * i + j for j in range(torch.randint(1, 5, (1,), generator=g).item())] for i in range(rows)]
        lengths = [16 * len(t) - 1 - i % 3 for i, t in enumerate(tables)]
        tokens = torch.randint(3, a.vocab_size, (rows,), generator=g).tolist()
        with torch.no_grad():
            want = eager(tokens, lengths, tables).clone()
            got = graphed(tokens, lengths, tables).clone()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert graphed.captured == [(1, 16), (4, 16), (8, 16)]


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["graphs", "compiled"])
def test_engine_with_graphs_gives_the_eager_tokens(compile, make_engine):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 40]
    params = SamplingParams(temperature=0, max_tokens=24)
    eager = make_engine(device="cuda", cuda_graphs=False, kv_cache_blocks=256)
    graphed = make_engine(device="cuda", cuda_graphs=True, compile=compile, kv_cache_blocks=256)
    assert isinstance(graphed.runner.decoder, GraphedDecoder)
    want = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    assert [s[0].token_ids for s in got] == [s[0].token_ids for s in want]
    assert graphed.runner.decoder.captured
