"""GLM-4.5 (GQA with q/k/v bias, qk-norm, partial rotary; DeepSeek-V3 MoE) against transformers in fp32.

transformers' oddities covered: `o_proj` has no bias even with `attention_bias`, `use_qk_norm` switches qk-norm,
`partial_rotary_factor` defaults to 0.5 when the config leaves it out, and the MTP layers checkpoints store after
the decoder (`num_nextn_predict_layers`) are not loaded.
"""

from __future__ import annotations

import functools

import pytest
import torch

from support.model_parity import (
    GLM4_MOE,
    assert_backends_agree,
    assert_cache_matches_forward,
    assert_packed_parity,
    assert_padded_parity,
    assert_round_trips_through_transformers,
    write_hf_model,
)
from tandem.models import ModelConfigError, load_model, model_args

CONFIG = GLM4_MOE
VARIANTS = {
    "qk-norm, biases": {},
    "no qk-norm, default partial rotary, 5 layers": {
        "use_qk_norm": False,
        "partial_rotary_factor": None,  # left out of config.json: transformers assumes 0.5
        "num_hidden_layers": 5,
        "first_k_dense_replace": 2,
        "n_group": 1,
        "norm_topk_prob": False,
    },
}


def _config(variant: str) -> dict:
    return {k: v for k, v in {**CONFIG, **VARIANTS[variant]}.items() if v is not None}


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    cache = {}

    def make(variant: str):
        if variant not in cache:
            cache[variant] = write_hf_model(tmp_path_factory.mktemp("glm4_moe"), _config(variant))
        return cache[variant]

    return make


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padded_and_packed_match_transformers(variant, variant_dir, hf_model):
    path = variant_dir(variant)
    model, hf = load_model(path).eval(), hf_model(path)
    assert model.args.rotary_dim == 6 and model.layers[0].self_attn.o_proj.bias is None
    assert_padded_parity(model, hf, variant)
    assert_packed_parity(model, hf, variant)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_round_trips_through_transformers(variant, variant_dir, tmp_path):
    path = variant_dir(variant)
    assert_round_trips_through_transformers(load_model(path), path, tmp_path / "saved")


@pytest.mark.parametrize("layout", ["paged", "slots"])
def test_prefill_then_decode_matches_full_forward(layout, variant_dir):
    assert_cache_matches_forward(load_model(variant_dir("qk-norm, biases")).eval(), layout)


def test_moe_backends_agree_in_values_and_gradients(variant_dir):
    path = variant_dir("qk-norm, biases")
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    assert_backends_agree(functools.partial(load_model, path), ids)


def test_unsupported_configs_are_named():
    with pytest.raises(ModelConfigError, match=r"partial_rotary_factor 1\.5"):
        model_args({**CONFIG, "partial_rotary_factor": 1.5})
    with pytest.raises(ModelConfigError, match="topk_group=3"):
        model_args({**CONFIG, "topk_group": 3})
    with pytest.raises(ModelConfigError, match="hidden_act"):
        model_args({**CONFIG, "hidden_act": "gelu"})
