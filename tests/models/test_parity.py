"""Logit parity with transformers in fp32: padded batches, packed sequences, RoPE scaling.

Tolerance: max abs difference below 1e-4 (fp32). Observed differences are ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.models import load_model, model_args
from tandem.models.layers import document_ids, document_mask, inv_frequencies
from tandem.testing import write_tiny_model
from tandem.testing.tiny import TINY_ARCHITECTURES as ARCHS

TOL = 1e-4  # fp32 max abs logit difference vs transformers


def _hf_packed_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The 4D additive mask transformers needs to keep packed documents apart (position restarts alone do not)."""
    allowed = document_mask(document_ids(position_ids))
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _packed(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batch_matches_transformers(arch, model_dir, hf_model):
    path = model_dir(arch)
    hf, model = hf_model(path), load_model(path).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.args.vocab_size, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        ref = hf(ids, attention_mask=mask).logits
        unmasked = model(ids)
    real = mask.bool()
    diff = (ours - ref)[real].abs().max().item()
    assert diff < TOL, f"{arch}: padded batch max abs diff {diff:.2e} >= {TOL}"
    # Row 0 has no padding: the mask path must equal the plain causal path.
    torch.testing.assert_close(ours[0], unmasked[0], atol=1e-5, rtol=0)
    assert ours.abs().max() > 0.5, "logits too small for the comparison to mean anything"


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_matches_transformers_and_per_sequence(arch, model_dir, hf_model):
    path = model_dir(arch)
    hf, model = hf_model(path), load_model(path).eval()
    rows = [_packed([5, 8, 3], model.args.vocab_size, seed=1), _packed([9, 7], model.args.vocab_size, seed=2)]
    ids, pos = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    with torch.no_grad():
        ours = model(ids, position_ids=pos)
        ref = hf(ids, position_ids=pos, attention_mask=_hf_packed_mask(pos)).logits
        leaky = hf(ids, position_ids=pos).logits
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"{arch}: packed max abs diff {diff:.2e} >= {TOL}"
    # The reference must be sensitive: without document isolation the logits are very different.
    assert (leaky - ref).abs().max() > 100 * TOL

    with torch.no_grad():
        for r, lengths in enumerate(([5, 8, 3], [9, 7])):
            start = 0
            for n in lengths:
                alone = model(ids[r : r + 1, start : start + n])[0]
                torch.testing.assert_close(ours[r, start : start + n], alone, atol=1e-5, rtol=0)
                start += n


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
        diff = (model(ids, position_ids=pos) - hf(ids, position_ids=pos).logits).abs().max().item()
    assert diff < TOL, f"{case}: max abs diff {diff:.2e} >= {TOL}"
