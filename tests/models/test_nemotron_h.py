"""Nemotron-H (Mamba-2 + attention + MLP blocks) against transformers in fp32.

transformers does not keep packed documents apart in its Mamba layers, so packed rows are compared with each document
run through transformers alone; padded rows are compared directly (transformers zeroes padding's inputs, which for left
and right padding equals tandem's reset at every padding token).
"""

from __future__ import annotations

import pytest
import torch

from support.hybrid_parity import (
    STATE_SLOTS,
    assert_chunked_equals_recurrent,
    assert_packed_row_equals_documents,
    assert_packed_rows_match_per_document,
    assert_padded_and_causal_parity,
    assert_state_cache_matches_forward,
)
from support.model_parity import assert_round_trips_through_transformers, hf_load, write_hf_model
from tandem.models import ModelRuntime, load_model, model_args
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

MOE_CONFIG = {
    **CONFIG,
    "hybrid_override_pattern": "M*E-E*M",
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 20,
    "moe_shared_expert_intermediate_size": 28,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
"""CONFIG with MoE blocks (`E`) at layers 2 and 4: 8 ungated squared-ReLU experts in 2 groups, top-3 from the best
group, weights scaled by 2.5, a shared expert of 28; the correction bias is randomised by `write_hf_model`."""


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
        model_args({**CONFIG, "hybrid_override_pattern": "M*X"})
    with pytest.raises(ModelConfigError, match="moe_latent_size"):
        model_args({**MOE_CONFIG, "moe_latent_size": 16})
    with pytest.raises(ModelConfigError, match="mlp_hidden_act"):
        model_args({**CONFIG, "mlp_hidden_act": "gelu"})


def test_padded_and_causal_match_transformers(model_dir):
    model, hf = load_model(model_dir).eval(), hf_load(model_dir)
    assert_padded_and_causal_parity(model, hf, "nemotron_h", 20)


def test_packed_rows_match_transformers_per_document(model_dir):
    assert_packed_rows_match_per_document(load_model(model_dir).eval(), hf_load(model_dir))


def test_packed_row_equals_documents_in_values_and_gradients(model_dir):
    """One packed row (documents straddling chunk edges, chunks of 8) against each document alone: outputs and
    every parameter's gradient."""
    assert_packed_row_equals_documents(load_model(model_dir), "A_log")


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
    state = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(1))
    assert_chunked_equals_recurrent(chunk_ssd, recurrent_ssd, _ssd_inputs(2, 19, seed=chunk), state, chunk)


def test_save_round_trips_through_transformers(model_dir, tmp_path):
    assert_round_trips_through_transformers(load_model(model_dir), model_dir, tmp_path / "saved")


def test_prefill_then_decode_matches_full_forward(model_dir):
    """Three prompts prefilled in two chunks (the second continues the conv and SSM states), then decoded token by
    token; a slot reused by a new sequence starts from zero."""
    model = load_model(model_dir).eval()
    state = StateCache.for_model(model.args, num_slots=STATE_SLOTS)
    assert sorted(state.recurrent) == [0, 3, 6] and state.recurrent[0].shape == (4, 6, 10, 14)
    assert_state_cache_matches_forward(model)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("nemotron_h_moe"), MOE_CONFIG, perturb=PERTURB)


def test_moe_blocks_are_parsed():
    args = model_args(MOE_CONFIG)
    assert args.layer_types[2] == args.layer_types[4] == "moe"
    moe = args.moe
    assert moe is not None and moe.layers == (2, 4) and moe.expert_activation == "relu2"
    assert moe.scoring == "sigmoid" and moe.score_correction_bias and (moe.n_group, moe.topk_group) == (2, 1)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_moe_blocks_match_transformers(backend, moe_dir, tmp_path):
    model, hf = load_model(moe_dir, runtime=ModelRuntime(moe_backend=backend)).eval(), hf_load(moe_dir)
    assert_padded_and_causal_parity(model, hf, f"nemotron_h moe {backend}", 20)
    assert_packed_rows_match_per_document(model, hf)
    assert_round_trips_through_transformers(model, moe_dir, tmp_path / "saved")


def test_moe_blocks_decode_from_the_state_cache(moe_dir):
    assert_state_cache_matches_forward(load_model(moe_dir).eval())
