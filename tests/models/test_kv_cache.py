"""KV cache: prefill + token-by-token decode reproduces full-forward logits, for paged and slot layouts."""

from __future__ import annotations

import pytest
import torch

from support.model_parity import assert_cache_matches_forward, cache_sequences, paged_tables
from support.tolerance import K_REORDERED, assert_close_scaled
from tandem.models import KVCache, load_model
from tandem.testing.tiny import TINY_ARCHITECTURES as ARCHS


def _cache(model, num_blocks: int, block_size: int) -> KVCache:
    return KVCache.for_model(model.args, num_blocks, block_size)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["paged", "slots"])
def test_prefill_then_decode_matches_full_forward(arch, layout, model_dir):
    assert_cache_matches_forward(load_model(model_dir(arch)).eval(), layout)


def test_chunked_prefill_and_mixed_step(model_dir):
    """A step may mix a prompt continuation (prefix already cached), a fresh prompt and a decode token."""
    model = load_model(model_dir("qwen3")).eval()
    seqs = cache_sequences(model.args.vocab_size)
    cache, tables = _cache(model, num_blocks=12, block_size=4), paged_tables(3, 4)
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        # Step 1: first 4 tokens of seq 0, the whole prompt of seq 2 (3 tokens).
        model.prefill(torch.cat([seqs[0][:4], seqs[2][:3]]), cache, cache.batch([4, 3], [0, 0], [tables[0], tables[2]]))
        # Step 2: rest of seq 0's prompt (5 more), all of seq 1's prompt, one decode token for seq 2.
        batch = cache.batch([5, 9, 1], [4, 0, 3], tables)
        logits = model.prefill(torch.cat([seqs[0][4:9], seqs[1][:9], seqs[2][3:4]]), cache, batch)
    for i, pos in enumerate((8, 8, 3)):
        assert_close_scaled(logits[i], full[i][pos], K_REORDERED, msg=f"sequence {i}")


def test_cache_batch_errors(model_dir):
    model = load_model(model_dir("qwen3"))
    cache = _cache(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="cache positions"):
        cache.batch([5], [0], [[0]])
    with pytest.raises(ValueError, match="-1 where the sequence needs a block"):
        cache.batch([5], [0], [[0, -1]])
    with pytest.raises(ValueError, match="out of range"):
        cache.batch([1], [0], [[7]])
    with pytest.raises(ValueError, match="one new token"):
        model.decode(torch.tensor([1]), cache, cache.batch([2], [0], [[0]]))
