"""Nemotron-H (Mamba-2 + attention + MLP blocks) against transformers in fp32.

transformers does not keep packed documents apart in its Mamba layers, so packed rows are compared with each document
run through transformers alone; padded rows are compared directly (transformers zeroes padding's inputs, which for left
and right padding equals tandem's reset at every padding token).
"""

from __future__ import annotations

import pytest
import torch

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
from tandem.models.config import ModelConfigError
from tandem.models.layers.mamba2 import chunk_ssd, recurrent_ssd
from tandem.models.layers.state_cache import StateCache

CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 256,
    "hidden_size": 72,
    "hybrid_override_pattern": "M*-M-*M",
    "num_hidden_layers": 7,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "intermediate_size": 88,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 6,
    "mamba_head_dim": 10,
    "ssm_state_size": 14,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "use_conv_bias": True,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
"""Tiny Nemotron-H: blocks mamba, attention, MLP, mamba, MLP, attention, mamba; 6 Mamba heads of 10 with B/C in 2
groups of state 14, conv of 4 taps, chunks of 8 (short rows span several); GQA 6/2 with head dim 12."""

PERTURB = ("norm.weight", "norm_f.weight", "dt_bias", "A_log", ".D")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("nemotron_h"), CONFIG, perturb=PERTURB)


def test_config_is_parsed():
    args = model_args(CONFIG)
    assert args.layer_types == ("mamba", "full_attention", "mlp", "mamba", "mlp", "full_attention", "mamba")
    assert args.block == "mixer" and args.rope_free and args.is_hybrid
    assert args.mamba is not None and args.mamba.conv_dim == 6 * 10 + 2 * 2 * 14 and args.mamba.chunk_size == 8
    listed = {**CONFIG, "layers_block_type": ["linear_attention", "full_attention", "mlp"]}
    del listed["hybrid_override_pattern"]
    assert model_args(listed).layer_types == ("mamba", "full_attention", "mlp")
    with pytest.raises(ModelConfigError, match="not supported"):
        model_args({**CONFIG, "hybrid_override_pattern": "M*E"})
    with pytest.raises(ModelConfigError, match="mlp_hidden_act"):
        model_args({**CONFIG, "mlp_hidden_act": "gelu"})


def test_padded_and_causal_match_transformers(model_dir):
    model, hf = load_model(model_dir).eval(), hf_load(model_dir)
    assert_padded_parity(model, hf, "nemotron_h")
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff < TOL, f"causal: max abs diff {diff:.2e}"


def test_packed_rows_match_transformers_per_document(model_dir):
    model, hf = load_model(model_dir).eval(), hf_load(model_dir)
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

    model = load_model(model_dir)
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
    assert any("A_log" in n for n in packed_grads)
    for name, grad in packed_grads.items():  # fp32 sums in another order: compare relative to the gradient's scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-4 * scale, rtol=0, msg=name)


def _ssd_inputs(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 4, 5, generator=g)
    dt = torch.rand(batch, seq, 4, generator=g) * 0.8
    A = -torch.rand(4, generator=g) * 3
    B = torch.randn(batch, seq, 2, 6, generator=g)
    C = torch.randn(batch, seq, 2, 6, generator=g)
    D = torch.randn(4, generator=g)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_equals_recurrent(chunk):
    """With resets anywhere (a chunk's first token, mid-chunk, consecutive) and an initial state; values and
    gradients of the inputs."""
    inputs = _ssd_inputs(2, 19, seed=chunk)
    resets = torch.zeros(2, 19, dtype=torch.bool)
    resets[:, 0] = True
    resets[0, [4, 8, 9, 13]] = True
    resets[1, [6, 16]] = True
    state = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(1))
    for r in (None, resets):
        ref_in = [t.clone().requires_grad_() for t in inputs]
        ref, ref_state = recurrent_ssd(*ref_in, resets=r, initial_state=state)
        our_in = [t.clone().requires_grad_() for t in inputs]
        out, out_state = chunk_ssd(*our_in, resets=r, initial_state=state, chunk_size=chunk)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_state, ref_state, atol=1e-5, rtol=1e-5)
        (ref.sum() + ref_state.sum()).backward()
        (out.sum() + out_state.sum()).backward()
        for a, b in zip(ref_in, our_in, strict=True):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4)


def test_save_round_trips_through_transformers(model_dir, tmp_path):
    assert_round_trips_through_transformers(load_model(model_dir), model_dir, tmp_path / "saved")


def test_prefill_then_decode_matches_full_forward(model_dir):
    """Three prompts prefilled in two chunks (the second continues the conv and SSM states), then decoded token by
    token; a slot reused by a new sequence starts from zero."""
    model = load_model(model_dir).eval()
    prompts, steps = (5, 11, 3), 4
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 256, (n + steps,), generator=g) for n in prompts]
    cache = KVCache.for_model(model.args, num_blocks=3, block_size=max(map(len, seqs)))
    state = StateCache.for_model(model.args, num_slots=4)
    assert sorted(state.recurrent) == [0, 3, 6] and state.recurrent[0].shape == (4, 6, 10, 14)
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
