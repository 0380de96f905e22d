"""Qwen3-Next (Gated DeltaNet + gated attention hybrid, MoE with a gated shared expert) against transformers in fp32.

transformers does not keep packed documents apart in its linear-attention layers, so packed rows are compared with
each document run through transformers alone; padded rows are compared directly (transformers zeroes padding's
inputs, which for left and right padding equals tandem's reset at every padding token).
"""

from __future__ import annotations

import pytest
import torch

from support.hybrid_models import QWEN3_NEXT
from support.model_parity import (
    PACKED_ROWS,
    TOL,
    assert_padded_parity,
    assert_round_trips_through_transformers,
    hf_load,
    packed,
    write_hf_model,
)
from tandem.models import KVCache, load_model, model_args
from tandem.models.layers.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tandem.models.layers.state_cache import StateCache

CONFIG = {**QWEN3_NEXT, "vocab_size": 256}
"""Tiny Qwen3-Next: layers linear, full, linear, full; layer 1 dense; 2 key heads serving 6 value heads (k dim 10,
v dim 14); GQA 6/2 with head dim 12 of which RoPE rotates 3 (partial rotary 0.25, left to transformers' default)."""

PERTURB = ("layernorm.weight", "norm.weight", "dt_bias", "A_log")  # zero-centred norms start at 0, dt_bias at 1


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
    assert_padded_parity(model, hf, f"chunk {chunk}")
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(3))  # two chunks of 64
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff < TOL, f"causal: max abs diff {diff:.2e}"


def test_packed_rows_match_transformers_per_document(model_dir):
    model, hf = _small_chunks(load_model(model_dir).eval()), hf_load(model_dir)
    rows = [packed(lengths, 256, seed=r + 1) for r, lengths in enumerate(PACKED_ROWS)]
    ids, pos = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    with torch.no_grad():
        ours = model(ids, position_ids=pos)
        leaky = model(ids)
        for r, lengths in enumerate(PACKED_ROWS):
            start = 0
            for n in lengths:
                ref = hf(ids[r : r + 1, start : start + n]).logits[0]
                diff = (ours[r, start : start + n] - ref).abs().max().item()
                assert diff < TOL, f"row {r} document at {start}: max abs diff {diff:.2e}"
                start += n
    assert (leaky - ours).abs().max() > 100 * TOL  # documents would leak into each other without the resets


def test_packed_row_equals_documents_in_values_and_gradients(model_dir):
    """One packed row (documents straddling chunk edges, chunks of 8) against each document alone: outputs and
    every parameter's gradient."""
    lengths = [5, 11, 3, 9]
    ids, pos = packed(lengths, 256, seed=7)
    weights = torch.randn(sum(lengths), 256, generator=torch.Generator().manual_seed(8))

    model = _small_chunks(load_model(model_dir))
    out = model(ids[None], position_ids=pos[None])[0]
    (out * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    start, outs = 0, []
    for n in lengths:
        alone = model(ids[None, start : start + n])[0]
        (alone * weights[start : start + n]).sum().backward()
        outs.append(alone.detach())
        start += n
    torch.testing.assert_close(out.detach(), torch.cat(outs), atol=2e-5, rtol=0)
    assert any("linear_attn" in n for n in packed_grads)
    for name, grad in packed_grads.items():  # fp32 sums in another order: compare relative to the gradient's scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-4 * scale, rtol=0, msg=name)


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
    q, k, v, decay, beta = _delta_inputs(2, 19, seed=chunk)
    resets = torch.zeros(2, 19, dtype=torch.bool)
    resets[:, 0] = True
    resets[0, [4, 8, 9, 13]] = True
    resets[1, [6, 16]] = True
    state = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(1))
    for r in (None, resets):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, decay, beta)]
        ref, ref_state = recurrent_gated_delta_rule(*inputs, resets=r, initial_state=state)
        inputs2 = [t.clone().requires_grad_() for t in (q, k, v, decay, beta)]
        out, out_state = chunk_gated_delta_rule(*inputs2, resets=r, initial_state=state, chunk_size=chunk)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_state, ref_state, atol=1e-5, rtol=1e-5)
        (ref.sum() + ref_state.sum()).backward()
        (out.sum() + out_state.sum()).backward()
        for a, b in zip(inputs, inputs2, strict=True):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4)


def test_save_round_trips_through_transformers(model_dir, tmp_path):
    assert_round_trips_through_transformers(load_model(model_dir), model_dir, tmp_path / "saved")


def test_prefill_then_decode_matches_full_forward(model_dir):
    """Three prompts prefilled in two chunks (the second continues the conv and recurrent states), then decoded
    token by token; a slot reused by a new sequence starts from zero."""
    model = _small_chunks(load_model(model_dir).eval(), 4)
    prompts, steps = (5, 11, 3), 4
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 256, (n + steps,), generator=g) for n in prompts]
    cache = KVCache.for_model(model.args, num_blocks=3, block_size=max(map(len, seqs)))
    state = StateCache.for_model(model.args, num_slots=4)
    state.recurrent[0].fill_(7.0)  # stale state in the slots must not leak into fresh sequences
    state.conv[0].fill_(7.0)
    tables, slots = [[2], [0], [1]], [3, 0, 1]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        first = [min(n, 3) for n in prompts]
        batch = cache.batch(first, [0, 0, 0], tables)
        model.prefill(torch.cat([s[:n] for s, n in zip(seqs, first, strict=True)]), cache, batch, state,
                      state.batch(slots, [0, 0, 0]))  # fmt: skip
        rest = [n - f for n, f in zip(prompts, first, strict=True)]
        live = [i for i, n in enumerate(rest) if n]
        batch = cache.batch([rest[i] for i in live], [first[i] for i in live], [tables[i] for i in live])
        logits = model.prefill(
            torch.cat([seqs[i][first[i] : prompts[i]] for i in live]),
            cache,
            batch,
            state,
            state.batch([slots[i] for i in live], [first[i] for i in live]),
        )
        for row, i in enumerate(live):
            torch.testing.assert_close(logits[row], full[i][prompts[i] - 1], atol=2e-5, rtol=0)
        for step in range(steps):
            lens = [n + step for n in prompts]
            batch = cache.batch([1, 1, 1], lens, tables)
            tokens = torch.stack([s[n] for s, n in zip(seqs, lens, strict=True)])
            logits = model.decode(tokens, cache, batch, state, state.batch(slots, lens))
            for i, n in enumerate(lens):
                torch.testing.assert_close(logits[i], full[i][n], atol=2e-5, rtol=0)


def test_cached_step_needs_the_state_cache(model_dir):
    model = load_model(model_dir).eval()
    cache = KVCache.for_model(model.args, num_blocks=1, block_size=8)
    with pytest.raises(ValueError, match="StateCache"):
        model.prefill(torch.tensor([5, 6]), cache, cache.batch([2], [0], [[0]]))
