"""KV cache: prefill + token-by-token decode reproduces full-forward logits, for paged and slot layouts."""

from __future__ import annotations

import pytest
import torch

from tandem.models import KVCache, load_model
from tandem.testing.tiny import TINY_ARCHITECTURES as ARCHS

PROMPTS = (5, 9, 3)
DECODE_STEPS = 4


def _cache(model, num_blocks: int, block_size: int) -> KVCache:
    a = model.args
    return KVCache(a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=torch.float32)


def _sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n + DECODE_STEPS,), generator=g) for n in PROMPTS]


def _paged_tables(num_seqs: int, blocks_per_seq: int) -> list[list[int]]:
    """Interleaved, non-contiguous block ids, so a wrong table lookup reads another sequence's keys."""
    ids = torch.randperm(num_seqs * blocks_per_seq, generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[i::num_seqs] for i in range(num_seqs)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["paged", "slots"])
def test_prefill_then_decode_matches_full_forward(arch, layout, model_dir):
    model = load_model(model_dir(arch)).eval()
    seqs = _sequences(model.args.vocab_size)
    max_len = max(len(s) for s in seqs)
    if layout == "paged":
        cache, tables = _cache(model, num_blocks=3 * 4, block_size=4), _paged_tables(3, 4)
    else:
        cache, tables = _cache(model, num_blocks=3, block_size=max_len), [[2], [0], [1]]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        batch = cache.batch(list(PROMPTS), [0, 0, 0], tables)
        logits = model.prefill(torch.cat([s[:n] for s, n in zip(seqs, PROMPTS, strict=True)]), cache, batch)
        for i, n in enumerate(PROMPTS):
            torch.testing.assert_close(logits[i], full[i][n - 1], atol=1e-5, rtol=0)
        for step in range(DECODE_STEPS):
            lens = [n + step for n in PROMPTS]
            batch = cache.batch([1, 1, 1], lens, tables)
            logits = model.decode(torch.stack([s[n] for s, n in zip(seqs, lens, strict=True)]), cache, batch)
            for i, n in enumerate(lens):
                torch.testing.assert_close(logits[i], full[i][n], atol=1e-5, rtol=0)


def test_chunked_prefill_and_mixed_step(model_dir):
    """A step may mix a prompt continuation (prefix already cached), a fresh prompt and a decode token."""
    model = load_model(model_dir("qwen3")).eval()
    seqs = _sequences(model.args.vocab_size)
    cache, tables = _cache(model, num_blocks=12, block_size=4), _paged_tables(3, 4)
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        # Step 1: first 4 tokens of seq 0, the whole prompt of seq 2 (3 tokens).
        model.prefill(torch.cat([seqs[0][:4], seqs[2][:3]]), cache, cache.batch([4, 3], [0, 0], [tables[0], tables[2]]))
        # Step 2: rest of seq 0's prompt (5 more), all of seq 1's prompt, one decode token for seq 2.
        batch = cache.batch([5, 9, 1], [4, 0, 3], tables)
        logits = model.prefill(torch.cat([seqs[0][4:9], seqs[1][:9], seqs[2][3:4]]), cache, batch)
    for i, pos in enumerate((8, 8, 3)):
        torch.testing.assert_close(logits[i], full[i][pos], atol=1e-5, rtol=0)


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
