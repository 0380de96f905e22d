"""DeepSeek-V3.2 (MLA restricted to the lightning indexer's top-k keys) against transformers in fp32.

A tiny V3.2 with odd sizes (hidden 72, 3 heads, latent rank 20, RoPE part 8, 9 indexer heads of 12) and
`index_topk` 4, far below the sequence lengths, so the indexer really chooses: a test checks that the logits
differ from attending to every key. Indexer biases (`k_norm.bias`) are randomised like every bias.

Exact score ties at the top-k cut (a key every indexer head scores negatively scores exactly 0) are broken by
`torch.topk` in transformers, differently for different lengths, and by "earliest key first" in tandem. The
comparisons with transformers therefore check that their inputs have no tie straddling the cut (`no_ties`;
9 indexer heads make ties rare), while tandem's own cached-vs-full checks also run a 5-head variant that has them.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import pytest
import torch

from support.inference import engine_config
from support.model_parity import (
    assert_cache_matches_forward,
    assert_packed_parity,
    assert_padded_parity,
    assert_round_trips_through_transformers,
    disk_tensors,
    hf_packed_mask,
    packed,
    write_hf_model,
)
from support.tolerance import K_REFERENCE, K_REORDERED, assert_close_scaled, ulps_apart
from tandem.inference.kv_budget import activation_bytes
from tandem.models import KVCache, ModelConfigError, ModelRuntime, build_model, load_model, model_args, save_model
from tandem.models.layers import attention_inputs, indexer
from tandem.models.layers.indexer import INDEX_BACKENDS, SparseMLAttention, index_scores, topk_selected

CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 256,
    "hidden_size": 72,
    "intermediate_size": 88,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "q_lora_rank": 28,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "index_n_heads": 9,
    "index_head_dim": 12,
    "index_topk": 4,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}
LONG = 24  # tokens in the longer checks: six times index_topk


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("deepseek_v32"), CONFIG)


@pytest.fixture(scope="module")
def model(v32_dir):
    return load_model(v32_dir).eval()


def dense_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights with index_topk above every length: MLA over all keys (DeepSeek-V3)."""
    args = model.args.replace(indexer=dataclasses.replace(model.args.indexer, topk=10_000))
    dense = build_model(args, seed=0).eval()
    dense.load_state_dict(model.state_dict())
    return dense


@contextmanager
def no_ties(monkeypatch):
    """Fail if, inside the block, any query's top-k cut falls inside a group of exactly tied scores."""
    straddling = []

    def checked(scores: torch.Tensor, topk: int) -> torch.Tensor:
        selected = topk_selected(scores, topk)
        cut = scores.topk(min(topk, scores.shape[-1]), dim=-1).values[..., -1:]
        tied = (scores == cut) & (scores != float("-inf"))
        straddling.append(int(((tied & selected).any(-1) & (tied & ~selected).any(-1)).sum()))
        return selected

    with monkeypatch.context() as patch:
        patch.setattr(indexer, "topk_selected", checked)
        yield
    assert straddling and not any(straddling), f"ties straddle the top-k cut: {straddling}"


def test_config_parsing(model):
    args = model.args
    assert (args.indexer.num_heads, args.indexer.head_dim, args.indexer.topk) == (9, 12, 4)
    assert args.kv_cache_shape == (1, 20 + 8 + 12, 0)  # latent, RoPE key, indexer key
    assert all(isinstance(layer.self_attn, SparseMLAttention) for layer in model.layers)
    defaults = model_args({k: v for k, v in CONFIG.items() if not k.startswith("index_")}).indexer
    assert (defaults.num_heads, defaults.head_dim, defaults.topk) == (64, 128, 2048)
    types = model_args({**CONFIG, "mlp_layer_types": ["dense", "sparse", "dense"]})
    assert types.moe.layers == (1,)


def test_padded_and_packed_match_transformers(model, v32_dir, hf_model, monkeypatch):
    hf = hf_model(v32_dir)
    with no_ties(monkeypatch):
        assert_padded_parity(model, hf, "v3.2")
        assert_packed_parity(model, hf, "v3.2")


def test_long_causal_and_padded_match_transformers_and_sparsity_matters(model, v32_dir, hf_model, monkeypatch):
    hf = hf_model(v32_dir)
    ids = torch.randint(3, 256, (3, LONG), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, LONG, dtype=torch.long)
    mask[1, 17:] = 0
    mask[2, :6] = 0
    with torch.no_grad(), no_ties(monkeypatch):
        causal, ref_causal = model(ids), hf(ids).logits
        padded, ref_padded = model(ids, mask=mask), hf(ids, attention_mask=mask).logits
        dense = dense_copy(model)(ids)
    assert_close_scaled(causal, ref_causal, K_REFERENCE, msg="causal")
    assert_close_scaled(padded[mask.bool()], ref_padded[mask.bool()], K_REFERENCE, msg="padded")
    # up to index_topk keys the selection is everything; beyond, it is not
    assert_close_scaled(causal[:, :4], dense[:, :4], K_REORDERED, msg="dense within index_topk")
    assert ulps_apart(causal[:, 4:], dense[:, 4:]) > 100 * K_REFERENCE


def test_packed_matches_each_document_through_transformers(model, v32_dir, hf_model, monkeypatch):
    """Packed rows (positions restart) against transformers run on each document alone (it has no packing), and
    against transformers given the document mask."""
    hf = hf_model(v32_dir)
    lengths = [9, 11, 4]
    ids, pos = packed(lengths, 256, seed=7)
    with torch.no_grad(), no_ties(monkeypatch):
        ours = model(ids[None], pos[None])[0]
        masked = hf(ids[None], position_ids=pos[None], attention_mask=hf_packed_mask(pos[None])).logits[0]
        assert_close_scaled(ours, masked, K_REFERENCE, msg="document mask")
        start = 0
        for n in lengths:
            alone = hf(ids[None, start : start + n]).logits[0]
            assert_close_scaled(ours[start : start + n], alone, K_REFERENCE, msg=f"document at {start}")
            start += n


def test_topk_respects_causality_and_documents():
    """The selection never includes a future key or another document's, and takes all keys when there are few."""
    g = torch.Generator().manual_seed(0)
    q, k, w = (
        torch.randn(2, 10, 3, 8, generator=g),
        torch.randn(2, 10, 8, generator=g),
        torch.randn(2, 10, 3, generator=g),
    )
    docs = torch.tensor([[0] * 6 + [1] * 4, [0] * 10])
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    selected = topk_selected(index_scores(q, k, w, 0.3, allowed), 3)
    assert not (selected & ~allowed).any()
    assert torch.equal(selected.sum(-1), allowed.sum(-1).clamp(max=3))
    causal = topk_selected(index_scores(q, k, w, 0.3, None), 3)
    assert torch.equal(causal[1], selected[1])


def test_flex_block_mask_gives_the_same_allowed_keys():
    """On CUDA, packed inputs come as a flex BlockMask; the indexer reads the same allowed keys out of it."""
    _, pos = packed([9, 11, 4], 256, seed=7)
    cpu = torch.device("cpu")
    masks = [indexer._allowed(attention_inputs(b, cpu, pos[None], None), 1, 24, cpu) for b in ("flex", "sdpa")]
    assert torch.equal(*masks)


def test_training_forward_has_gradients_except_the_indexer(model):
    """The top-k choice is discrete and the indexer runs without gradient (as in transformers); everything else
    trains through the sparse attention."""
    trained = build_model(model.args, seed=0)
    ids = torch.randint(3, 256, (2, LONG), generator=torch.Generator().manual_seed(3))
    trained(ids, torch.arange(LONG).repeat(2, 1)).logsumexp(-1).sum().backward()
    for name, param in trained.named_parameters():
        if ".indexer." in name or name.endswith("e_score_correction_bias"):
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_save_round_trips_through_transformers(model, v32_dir, tmp_path, monkeypatch):
    keys = disk_tensors(v32_dir)
    assert "model.layers.0.self_attn.indexer.k_norm.bias" in keys
    with no_ties(monkeypatch):
        assert_round_trips_through_transformers(model, v32_dir, tmp_path / "saved")


def test_random_model_round_trips_through_transformers(tmp_path, monkeypatch):
    model = build_model(CONFIG, seed=0).eval()
    assert torch.equal(model.layers[0].self_attn.indexer.k_norm.weight, torch.ones(12))
    with no_ties(monkeypatch):
        assert_round_trips_through_transformers(model, save_model(model, tmp_path / "first"), tmp_path / "second")


def test_ties_go_to_the_earliest_keys_whatever_the_length():
    scores = torch.tensor([[0.0, 0.5, 0.0, -1.0, 0.0, 0.2, 0.0]])
    expected = torch.tensor([[True, True, True, False, False, True, False]])
    assert torch.equal(topk_selected(scores, 4), expected)
    for extra in (1, 9, 3000):  # more (masked) keys: the selection among the first 7 is the same
        longer = torch.cat((scores, torch.full((1, extra), float("-inf"))), dim=-1)
        assert torch.equal(topk_selected(longer, 4)[:, :7], expected)
    few = torch.tensor([[0.0, float("-inf"), 0.0]])  # fewer allowed keys than topk: all of them
    assert torch.equal(topk_selected(few, 4), torch.tensor([[True, False, True]]))


@pytest.fixture(scope="module", params=[9, 5], ids=["9 index heads", "5 index heads, tied cuts"])
def cache_model(request, model, tmp_path_factory):
    if request.param == 9:
        return model
    path = write_hf_model(tmp_path_factory.mktemp("deepseek_v32_5"), {**CONFIG, "index_n_heads": 5})
    return load_model(path).eval()


@pytest.mark.parametrize("layout", ["paged", "slots"])
def test_cache_prefill_then_decode_matches_full_forward(cache_model, layout):
    assert_cache_matches_forward(cache_model, layout)


def test_cache_long_chunked_prefill_and_decode_match_full_forward(cache_model):
    model = cache_model
    """Sequences well past index_topk: a chunked prefill (two chunks) then decode, against the full forward."""
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 256, (n,), generator=g) for n in (LONG, 15)]
    cache = KVCache.for_model(model.args, num_blocks=16, block_size=4)
    tables = [[1, 3, 5, 7, 9, 11, 13, 15], [0, 2, 4, 6, 8, 10, 12, 14]]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        batch = cache.batch([10, 6], [0, 0], tables)
        model.prefill(torch.cat([seqs[0][:10], seqs[1][:6]]), cache, batch)
        batch = cache.batch([8, 5], [10, 6], tables)
        hidden = model.cached_hidden_states(torch.cat([seqs[0][10:18], seqs[1][6:11]]), cache, batch)
        torch.testing.assert_close(model.compute_logits(hidden[:8]), full[0][10:18], atol=1e-5, rtol=0)
        torch.testing.assert_close(model.compute_logits(hidden[8:]), full[1][6:11], atol=1e-5, rtol=0)
        lens = [18, 11]
        for _ in range(4):
            batch = cache.batch([1, 1], lens, tables)
            logits = model.decode(torch.stack([s[n] for s, n in zip(seqs, lens, strict=True)]), cache, batch)
            for i, n in enumerate(lens):
                torch.testing.assert_close(logits[i], full[i][n], atol=1e-5, rtol=0)
            lens = [n + 1 for n in lens]


def test_unsupported_configs_are_named():
    with pytest.raises(ModelConfigError, match="q_lora_rank"):
        model_args({**CONFIG, "q_lora_rank": None})
    with pytest.raises(ModelConfigError, match="rope_interleave"):
        model_args({**CONFIG, "rope_interleave": False})
    with pytest.raises(ModelConfigError, match="index_head_dim"):
        model_args({**CONFIG, "index_head_dim": 6})
    with pytest.raises(ModelConfigError, match="mlp_layer_types"):
        model_args({**CONFIG, "mlp_layer_types": ["dense"]})


# --- the Triton indexer-score kernel (CPU: Triton's interpreter) ---------------------------------------------

needs_triton = pytest.mark.skipif(
    torch.cuda.is_available() is False and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where Triton runs its kernels: the GPU when there is one (the interpreter is then off), else the CPU."""


@pytest.fixture(scope="module")
def triton_scores():
    pytest.importorskip("triton", reason="the Triton indexer kernel needs the triton package")
    from tandem.kernels.indexer import index_scores_triton

    INDEX_BACKENDS.setdefault("triton", index_scores_triton)
    return index_scores_triton


@needs_triton
@pytest.mark.parametrize("masking", ["causal", "documents", "cached"])
def test_triton_index_scores_match_torch(triton_scores, masking):
    g = torch.Generator().manual_seed(1)
    batch, seq, keys, heads, dim = 2, 21, 21, 5, 12
    if masking == "cached":
        seq = 3  # the last 3 queries of 21 keys, causal: a prefill chunk after cached tokens
    q = torch.randn(batch, seq, heads, dim, generator=g).to(KERNEL_DEVICE)
    k = torch.randn(batch, keys, dim, generator=g).to(KERNEL_DEVICE)
    w = torch.randn(batch, seq, heads, generator=g).to(KERNEL_DEVICE)
    allowed = None
    if masking == "documents":
        docs = torch.tensor([[0] * 7 + [1] * 10 + [2] * 4, [0] * 21])
        allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(seq, keys, dtype=torch.bool).tril()
        allowed = allowed.to(KERNEL_DEVICE)
    want = index_scores(q, k, w, dim**-0.5, allowed)
    got = triton_scores(q, k, w, dim**-0.5, allowed)
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    finite = want != float("-inf")
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(topk_selected(got, 4), topk_selected(want, 4))


@needs_triton
def test_model_with_triton_index_backend_matches_torch(v32_dir, triton_scores):
    ids, pos = (t[None].to(KERNEL_DEVICE) for t in packed([9, 11, 4], 256, seed=7))
    with torch.no_grad():
        want = load_model(v32_dir, device=KERNEL_DEVICE).eval()(ids, pos)
        got = load_model(v32_dir, device=KERNEL_DEVICE, runtime=ModelRuntime(index_backend="triton")).eval()(ids, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_engine_budgets_the_indexer_scores():
    """A prefill chunk's indexer scores (fp32, per indexer head, against the whole context, before and after the
    ReLU) are counted in the engine's step temporaries, on top of what the same model without an indexer needs."""
    args = model_args(CONFIG)
    config = engine_config("unused", max_prefill_tokens=64, seq_len=256)
    without = activation_bytes(config, dataclasses.replace(args, indexer=None), torch.float32)
    assert args.indexer is not None
    assert activation_bytes(config, args, torch.float32) - without == 2 * 64 * args.indexer.num_heads * 256 * 4
