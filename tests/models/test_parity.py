"""Logit parity with transformers in fp32: padded batches, packed sequences, RoPE scaling.

Tolerance: max abs difference below 1e-4 (fp32). Observed differences are ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from support.model_parity import assert_packed_parity, assert_padded_parity
from support.tolerance import K_REFERENCE, assert_close_scaled
from tandem.models import load_model, model_args
from tandem.models.layers import inv_frequencies
from tandem.testing import write_tiny_model
from tandem.testing.tiny import TINY_ARCHITECTURES as ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batch_matches_transformers(arch, model_dir, hf_model):
    path = model_dir(arch)
    assert_padded_parity(load_model(path).eval(), hf_model(path), arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_matches_transformers_and_per_sequence(arch, model_dir, hf_model):
    path = model_dir(arch)
    assert_packed_parity(load_model(path).eval(), hf_model(path), arch)


ROPE_CASES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0}),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(case, tmp_path):
    arch, scaling = ROPE_CASES[case]
    path = write_tiny_model(tmp_path, arch, initializer_range=0.1, rope_parameters={"rope_theta": 10000.0, **scaling})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()  # dense
    model = load_model(path).eval()
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf.config, "cpu")
    freq, scale = inv_frequencies(model_args(path).rope, model.args.head_dim)
    torch.testing.assert_close(freq, ref_freq, atol=0, rtol=1e-6)
    assert scale == pytest.approx(ref_scale)
    ids = torch.randint(3, model.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    pos = 1000 + torch.arange(40)[None]  # far positions, where the scaling matters (one document)
    with torch.no_grad():
        assert_close_scaled(model(ids, pos), hf(ids, position_ids=pos).logits, K_REFERENCE, msg=case)
