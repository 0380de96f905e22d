"""Qwen3-Next (Gated DeltaNet + gated attention hybrid, MoE with a gated shared expert) against transformers in fp32.

transformers does not keep packed documents apart in its linear-attention layers, so packed rows are compared with
each document run through transformers alone; padded rows are compared directly (transformers zeroes padding's
inputs, which for left and right padding equals tandem's reset at every padding token).
"""

from __future__ import annotations

import pytest
import torch

from support.hybrid_models import PERTURB, QWEN3_NEXT
from support.hybrid_parity import (
    assert_chunked_equals_recurrent,
    assert_packed_row_equals_documents,
    assert_packed_rows_match_per_document,
    assert_padded_and_causal_parity,
    assert_state_cache_matches_forward,
)
from support.model_parity import assert_round_trips_through_transformers, hf_load, write_hf_model
from tandem.models import KVCache, load_model, model_args
from tandem.models.layers.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule

CONFIG = {**QWEN3_NEXT, "vocab_size": 256}
"""Tiny Qwen3-Next: layers linear, full, linear, full; layer 1 dense; 2 key heads serving 6 value heads (k dim 10,
v dim 14); GQA 6/2 with head dim 12 of which RoPE rotates 3 (partial rotary 0.25, left to transformers' default)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("qwen3_next"), CONFIG, perturb=PERTURB)


def _small_chunks(model: torch.nn.Module, size: int = 8) -> torch.nn.Module:
    """Chunks of `size` so that short test rows span several chunks and documents straddle chunk edges."""
    for layer in model.layers:
        if layer.layer_type == "linear_attention":
            layer.linear_attn.chunk_size = size
    return model


def test_config_is_parsed():
    args = model_args(CONFIG)
    assert args.layer_types == ("linear_attention", "full_attention") * 2
    assert args.rotary_dim == 3 and args.attn_output_gate and args.zero_centered_norm
    assert args.moe is not None and args.moe.layers == (0, 2, 3) and args.moe.shared_expert_gate
    assert args.linear is not None and args.linear.conv_dim == 2 * 2 * 10 + 6 * 14


@pytest.mark.parametrize("chunk", [64, 8])
def test_padded_and_causal_match_transformers(chunk, model_dir):
    model, hf = _small_chunks(load_model(model_dir).eval(), chunk), hf_load(model_dir)
    assert_padded_and_causal_parity(model, hf, f"chunk {chunk}", 70)  # causal rows: two chunks of 64


def test_packed_rows_match_transformers_per_document(model_dir):
    assert_packed_rows_match_per_document(_small_chunks(load_model(model_dir).eval()), hf_load(model_dir))


def test_packed_row_equals_documents_in_values_and_gradients(model_dir):
    """One packed row (documents straddling chunk edges, chunks of 8) against each document alone: outputs and
    every parameter's gradient."""
    assert_packed_row_equals_documents(_small_chunks(load_model(model_dir)), "linear_attn")


def _delta_inputs(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, 2, 6, generator=g)
    k = torch.randn(batch, seq, 2, 6, generator=g)
    v = torch.randn(batch, seq, 4, 5, generator=g)
    decay = -torch.rand(batch, seq, 4, generator=g) * 2
    beta = torch.rand(batch, seq, 4, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_equals_recurrent(chunk):
    """With resets anywhere (a chunk's first token, mid-chunk, consecutive) and an initial state; values and
    gradients of the inputs."""
    state = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(1))
    inputs = _delta_inputs(2, 19, seed=chunk)
    assert_chunked_equals_recurrent(chunk_gated_delta_rule, recurrent_gated_delta_rule, inputs, state, chunk)


def test_save_round_trips_through_transformers(model_dir, tmp_path):
    assert_round_trips_through_transformers(load_model(model_dir), model_dir, tmp_path / "saved")


def test_prefill_then_decode_matches_full_forward(model_dir):
    """Three prompts prefilled in two chunks (the second continues the conv and recurrent states), then decoded
    token by token; a slot reused by a new sequence starts from zero."""
    assert_state_cache_matches_forward(_small_chunks(load_model(model_dir).eval(), 4))


def test_cached_step_needs_the_state_cache(model_dir):
    model = load_model(model_dir).eval()
    cache = KVCache.for_model(model.args, num_blocks=1, block_size=8)
    with pytest.raises(ValueError, match="StateCache"):
        model.prefill(torch.tensor([5, 6]), cache, cache.batch([2], [0], [[0]]))
