"""Kept ids on the wire: round trips, the shorter encoding wins, and the decoded kept matrix is what
token_logprobs takes."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from tandem.models import reference_token_logprobs
from tandem.wire.kept_ids import decode_kept_ids, decode_kept_matrix, encode_kept_ids


@pytest.mark.parametrize("size", [0, 1, 20, 500, 5_000, 151_935])
def test_round_trip_any_size(size):
    vocab = 151_936
    ids = random.Random(size).sample(range(vocab), size)
    encoded = encode_kept_ids(ids, vocab)
    assert decode_kept_ids(encoded) == sorted(ids)
    assert len(encoded) <= 4 * (min(4 * size, (vocab + 7) // 8) + 3) // 3 + 1


def test_small_sets_are_id_lists_and_dense_sets_are_bitmaps():
    assert encode_kept_ids([7, 3], 1000).startswith("i")
    assert encode_kept_ids(range(0, 1000, 2), 1000).startswith("b")
    assert decode_kept_ids(encode_kept_ids([999, 0], 1000)) == [0, 999]


def test_bad_encodings_are_rejected():
    with pytest.raises(ValueError, match="must lie in"):
        encode_kept_ids([10], 10)
    with pytest.raises(ValueError, match="unknown kept-ids encoding"):
        decode_kept_ids("xAAAA")
    with pytest.raises(ValueError):
        decode_kept_ids("iAAA")  # not whole int32 values


def test_the_kept_matrix_feeds_token_logprobs():
    torch.manual_seed(0)
    vocab = 50
    hidden, weight = torch.randn(3, 8), torch.randn(vocab, 8)
    kept = [[4, 9, 11], None, [2, 30]]
    rows = decode_kept_matrix([encode_kept_ids(k, vocab) if k else None for k in kept])
    assert rows[1] == [-1, -1, -1] and rows[2] == [2, 30, -1]
    targets = torch.tensor([9, 17, 30])
    got = reference_token_logprobs(hidden, weight, targets, kept_matrix=torch.tensor(rows)).logprobs
    logits = hidden @ weight.T
    for i, ids in enumerate(kept):
        allowed = torch.tensor(ids) if ids else torch.arange(vocab)
        expected = logits[i, targets[i]] - logits[i, allowed].logsumexp(-1)
        torch.testing.assert_close(got[i], expected)


def test_the_wire_package_loads_without_torch_or_another_tandem_package():
    """Both ends of a hop import the contract: a client must not pull in the engine (or torch) to speak it."""
    code = (
        "import sys; import tandem.wire.protocol, tandem.wire.kept_ids, tandem.wire.codec; "
        "others = sorted(m for m in sys.modules if m.startswith('tandem.') and not m.startswith('tandem.wire')); "
        "assert 'torch' not in sys.modules, 'torch was imported'; assert not others, others"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
