"""Which attention path a training forward takes: flex needs heads of at least 16 dims (its kernels refuse smaller
ones), so `auto` keeps such models on masked SDPA even on CUDA and an explicit `flex` is a clear error."""

from __future__ import annotations

import pytest
import torch

from tandem.models.layers.attention import FLEX_MIN_HEAD_DIM, attention_inputs

PACKED = torch.cat([torch.arange(5), torch.arange(7)])[None]  # two documents in one row


def test_auto_takes_masked_sdpa_for_heads_flex_cannot_run():
    attn = attention_inputs("auto", torch.device("cuda"), PACKED, None, head_dims=(12, 12))
    assert attn.block_mask is None and attn.mask is not None
    assert attn.resets.tolist() == [[i in (0, 5) for i in range(12)]]


def test_explicit_flex_with_small_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=f"flex needs heads of at least {FLEX_MIN_HEAD_DIM} dims, got \\(32, 8\\)"):
        attention_inputs("flex", torch.device("cpu"), PACKED, None, head_dims=(32, 8))
