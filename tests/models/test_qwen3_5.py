"""Qwen3.5 text models against transformers in fp32, dense and MoE: `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`
(Qwen3-Next's hybrid with the Gated DeltaNet's input projections stored apart), and the text decoder of a
`...ForConditionalGeneration` checkpoint (text_config, `model.language_model.*`, a vision tower to skip), saved back
as a text checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from support.hybrid_models import PERTURB, QWEN3_5, QWEN3_5_MOE
from support.hybrid_parity import assert_packed_row_equals_documents, assert_padded_and_causal_parity
from support.model_parity import assert_round_trips_through_transformers, hf_load, write_hf_model
from support.tolerance import K_REFERENCE, assert_close_scaled, ulps_apart
from tandem.models import load_model, model_args, save_model

CONFIGS = {"dense": {**QWEN3_5, "vocab_size": 256}, "moe": {**QWEN3_5_MOE, "vocab_size": 256}}
MULTIMODAL = {
    "dense": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, "Qwen3_5ForCausalLM"),
    "moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, "Qwen3_5MoeForCausalLM"),
}
VISION = {
    "depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": QWEN3_5["hidden_size"],
    "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
}  # fmt: skip
"""A one-block vision tower: only there to be skipped on load."""


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, family):
    return write_hf_model(tmp_path_factory.mktemp(f"qwen3_5_{family}"), CONFIGS[family], perturb=PERTURB)


def test_config_is_parsed():
    args = model_args(CONFIGS["dense"])
    assert args.layer_types == ("linear_attention", "full_attention") * 2
    assert args.moe is None and args.attn_output_gate and args.zero_centered_norm and args.rotary_dim == 3
    assert args.linear is not None and args.linear.flat_projections
    moe = model_args(CONFIGS["moe"]).moe
    assert moe is not None and moe.layers == (0, 1, 2, 3) and moe.norm_topk_prob and moe.shared_expert_gate


def test_logits_match_transformers_and_the_checkpoint_round_trips(model_dir, tmp_path):
    model, hf = load_model(model_dir).eval(), hf_load(model_dir)
    assert_padded_and_causal_parity(model, hf, "qwen3.5", 70)  # two chunks of 64
    assert_round_trips_through_transformers(model, model_dir, tmp_path / "saved")


def test_packed_row_equals_documents_in_values_and_gradients(model_dir):
    assert_packed_row_equals_documents(load_model(model_dir), "linear_attn")


def test_the_scaled_bound_fails_a_weight_one_percent_off(model_dir):
    """The dtype-scaled tolerance is not vacuous: one attention output weight scaled by 1.01 lands far outside K_REFERENCE."""
    model, hf = load_model(model_dir).eval(), hf_load(model_dir)
    ids = torch.randint(3, model.args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        assert_close_scaled(model(ids), want, K_REFERENCE)
        model.layers[1].self_attn.o_proj.weight.mul_(1.01)
        assert ulps_apart(model(ids), want) > 4 * K_REFERENCE
        with pytest.raises(AssertionError, match="ulps"):
            assert_close_scaled(model(ids), want, K_REFERENCE)


def test_the_text_decoder_of_a_multimodal_checkpoint_loads_and_saves_as_text(tmp_path, family):
    config_cls, model_cls, text_architecture = MULTIMODAL[family]
    text = {k: v for k, v in CONFIGS[family].items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    reference = model_cls(config_cls(text_config=text, vision_config=VISION)).eval()
    reference.save_pretrained(tmp_path / "vl")
    model = load_model(tmp_path / "vl").eval()
    ids = torch.randint(3, text["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert_close_scaled(model(ids), expected, K_REFERENCE, msg="multimodal checkpoint")

    save_model(model, tmp_path / "text")
    saved = json.loads((tmp_path / "text" / "config.json").read_text())
    assert saved["architectures"] == [text_architecture]
    with torch.no_grad():
        assert_close_scaled(hf_load(tmp_path / "text")(ids).logits, expected, K_REFERENCE, msg="saved as text")
