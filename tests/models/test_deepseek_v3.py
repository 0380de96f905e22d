"""DeepSeek-V3 (MLA + group-limited sigmoid MoE with shared experts) against transformers in fp32.

Odd sizes everywhere (hidden 72, 3 heads, latent rank 20, RoPE part 8), a dense first layer, 8 experts in 2
groups of which 1 is kept, top-3; correction and projection biases randomised (transformers zeroes them).
"""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import save_file

from support.model_parity import (
    DEEPSEEK_V3,
    assert_backends_agree,
    assert_cache_matches_forward,
    assert_packed_parity,
    assert_padded_parity,
    assert_round_trips_through_transformers,
    disk_tensors,
    hf_load,
    write_hf_model,
)
from support.tolerance import K_REFERENCE, assert_close_scaled
from tandem.models import ModelConfigError, build_model, load_model, model_args, save_model
from tandem.models.layers.mla import MLAttention

CONFIG = DEEPSEEK_V3
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
VARIANTS = {
    "low-rank q": {},
    "direct q, half-split rope": {"q_lora_rank": None, "rope_interleave": False},
    "biases, 4 layers, 2 dense": {"attention_bias": True, "num_hidden_layers": 4, "first_k_dense_replace": 2},
    "yarn with mscale_all_dim": {"rope_scaling": YARN, "max_position_embeddings": 256},
}


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    cache = {}

    def make(variant: str):
        if variant not in cache:
            cache[variant] = write_hf_model(tmp_path_factory.mktemp("deepseek_v3"), {**CONFIG, **VARIANTS[variant]})
        return cache[variant]

    return make


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padded_and_packed_match_transformers(variant, variant_dir, hf_model):
    path = variant_dir(variant)
    model, hf = load_model(path).eval(), hf_model(path)
    assert all(isinstance(layer.self_attn, MLAttention) for layer in model.layers)
    assert_padded_parity(model, hf, variant)
    assert_packed_parity(model, hf, variant)


def test_yarn_far_positions_match_transformers(variant_dir, hf_model):
    """Positions beyond the original context, where YaRN's frequencies and mscale softmax scale matter."""
    path = variant_dir("yarn with mscale_all_dim")
    model, hf = load_model(path).eval(), hf_model(path)
    assert model.layers[0].self_attn.scale != pytest.approx(20**-0.5)
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    pos = 200 + torch.arange(30)[None]
    with torch.no_grad():
        assert_close_scaled(model(ids, pos), hf(ids, position_ids=pos).logits, K_REFERENCE)


@pytest.mark.parametrize("variant", ["low-rank q", "direct q, half-split rope"])
def test_save_round_trips_through_transformers(variant, variant_dir, tmp_path):
    path = variant_dir(variant)
    assert_round_trips_through_transformers(load_model(path), path, tmp_path / "saved")


def test_random_model_round_trips_through_transformers(tmp_path):
    """A tandem-initialised model saves to a directory transformers loads (nothing missing) to the same logits."""
    model = build_model(CONFIG, seed=0).eval()
    assert_round_trips_through_transformers(model, save_model(model, tmp_path / "first"), tmp_path / "second")


@pytest.mark.parametrize("layout", ["paged", "slots"])
@pytest.mark.parametrize("variant", ["low-rank q", "direct q, half-split rope"])
def test_latent_cache_prefill_then_decode_matches_full_forward(variant, layout, variant_dir):
    model = load_model(variant_dir(variant)).eval()
    assert model.args.kv_cache_shape == (1, 20 + 8, 0)  # one latent + RoPE key per token, no values
    assert_cache_matches_forward(model, layout)


def test_moe_backends_agree_in_values_and_gradients(variant_dir):
    path = variant_dir("low-rank q")
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    assert_backends_agree(functools.partial(load_model, path), ids)


def test_mtp_layer_weights_are_ignored_on_load(variant_dir, tmp_path):
    """Checkpoints store `num_nextn_predict_layers` MTP layers after the decoder; they load as transformers does."""
    src = variant_dir("low-rank q")
    tensors = disk_tensors(src)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(72, 144)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(66, 20)
    path = tmp_path / "with_mtp"
    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text((src / "config.json").read_text())
    ids = torch.randint(3, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_model(path)(ids), load_model(src)(ids), atol=0, rtol=0)
        assert_close_scaled(load_model(path)(ids), hf_load(src)(ids).logits, K_REFERENCE)


def test_unsupported_configs_are_named():
    with pytest.raises(ModelConfigError, match="scoring_func='softmax'"):
        model_args({**CONFIG, "scoring_func": "softmax"})
    with pytest.raises(ModelConfigError, match="quantized"):
        model_args({**CONFIG, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ModelConfigError, match="num_key_value_heads must be 3"):
        model_args({**CONFIG, "num_key_value_heads": 1})
    with pytest.raises(ModelConfigError, match="n_group=3 does not divide"):
        model_args({**CONFIG, "n_group": 3})
    with pytest.raises(ModelConfigError, match="partial_rotary_factor"):
        model_args({**CONFIG, "partial_rotary_factor": 0.5})
