"""Mask encoding: round trips, the shorter encoding wins, and the decoded rows are what token_logprobs takes."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from tandem.inference.masks import decode_mask, encode_mask, kept_ids_rows
from tandem.models import reference_token_logprobs


@pytest.mark.parametrize("size", [0, 1, 20, 500, 5_000, 151_935])
def test_round_trip_any_size(size):
    vocab = 151_936
    ids = random.Random(size).sample(range(vocab), size)
    encoded = encode_mask(ids, vocab)
    assert decode_mask(encoded) == sorted(ids)
    assert len(encoded) <= 4 * (min(4 * size, (vocab + 7) // 8) + 3) // 3 + 1


def test_small_sets_are_id_lists_and_dense_sets_are_bitmaps():
    assert encode_mask([7, 3], 1000).startswith("i")
    assert encode_mask(range(0, 1000, 2), 1000).startswith("b")
    assert decode_mask(encode_mask([999, 0], 1000)) == [0, 999]


def test_bad_masks_are_rejected():
    with pytest.raises(ValueError, match="must lie in"):
        encode_mask([10], 10)
    with pytest.raises(ValueError, match="unknown mask encoding"):
        decode_mask("xAAAA")
    with pytest.raises(ValueError):
        decode_mask("iAAA")  # not whole int32 values


def test_rows_feed_token_logprobs_kept_ids():
    torch.manual_seed(0)
    vocab = 50
    hidden, weight = torch.randn(3, 8), torch.randn(vocab, 8)
    kept = [[4, 9, 11], None, [2, 30]]
    rows = kept_ids_rows([encode_mask(k, vocab) if k else None for k in kept])
    assert rows[1] == [-1, -1, -1] and rows[2] == [2, 30, -1]
    targets = torch.tensor([9, 17, 30])
    got = reference_token_logprobs(hidden, weight, targets, kept_ids=torch.tensor(rows)).logprobs
    logits = hidden @ weight.T
    for i, ids in enumerate(kept):
        allowed = torch.tensor(ids) if ids else torch.arange(vocab)
        expected = logits[i, targets[i]] - logits[i, allowed].logsumexp(-1)
        torch.testing.assert_close(got[i], expected)


def test_masks_module_needs_only_the_standard_library():
    code = "import sys; import tandem.inference.masks; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
