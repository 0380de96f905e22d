"""Qwen3-VL's vision encoder against transformers' `Qwen3VLVisionModel` in fp32, on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from support.vision_models import tower_pair, tower_pixels
from tandem.models.layers.vision import Qwen3VisionEncoder, VisionArgs, merged_tokens

CONFIG = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 24,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 2],
}
TOL = 1e-5


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, Qwen3VisionEncoder]:
    """The HF model with every parameter perturbed (so biases and norms matter), and tandem's with its weights."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return tower_pair(Qwen3VLVisionModel, Qwen3VLVisionConfig(**CONFIG), Qwen3VisionEncoder, VisionArgs)


@pytest.mark.parametrize(
    "grid",
    [[[1, 4, 6], [1, 8, 4]], [[1, 4, 4], [2, 4, 4], [1, 2, 10]]],
    ids=["two-images", "images-and-video"],
)
def test_matches_transformers(models, grid):
    hf, ours = models
    grid_thw = torch.tensor(grid)
    pixels = tower_pixels(grid_thw, ours.args.patch_dim)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid_thw)
        merged, deepstack = ours(pixels, grid_thw)
    rows = int(merged_tokens(grid_thw, 2).sum())
    assert merged.shape == expected.pooler_output.shape == (rows, 24)
    assert (merged - expected.pooler_output).abs().max() < TOL
    assert len(deepstack) == len(expected.deepstack_features) == 2
    for got, want in zip(deepstack, expected.deepstack_features, strict=True):
        assert got.shape == want.shape == (rows, 24)
        assert (got - want).abs().max() < TOL


def test_images_do_not_attend_to_each_other(models):
    _, ours = models
    grid_thw = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixels = tower_pixels(grid_thw, ours.args.patch_dim)
    tokens = merged_tokens(grid_thw, 2).tolist()
    with torch.no_grad():
        merged, deepstack = ours(pixels, grid_thw)
        for i, (start, count) in enumerate(zip((0, tokens[0]), tokens, strict=True)):
            patches = slice(4 * start, 4 * (start + count))
            alone, alone_deepstack = ours(pixels[patches], grid_thw[i : i + 1])
            assert (alone - merged[start : start + count]).abs().max() < TOL
            for got, together in zip(alone_deepstack, deepstack, strict=True):
                assert (got - together[start : start + count]).abs().max() < TOL


def test_merged_tokens():
    assert merged_tokens(torch.tensor([[1, 4, 6], [2, 8, 4]]), 2).tolist() == [6, 16]


def test_from_hf_defaults_and_rejections():
    args = VisionArgs.from_hf({})
    assert (args.depth, args.hidden_size, args.num_heads, args.out_hidden_size) == (27, 1152, 16, 3584)
    assert args.deepstack_visual_indexes == (8, 16, 24) and args.rope_theta == 10000.0
    assert VisionArgs.from_hf({**CONFIG, "rope_parameters": {"rope_type": "axial", "rope_theta": 5.0}}).rope_theta == 5
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu'"):
        VisionArgs.from_hf({**CONFIG, "hidden_act": "quick_gelu"})
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        VisionArgs.from_hf({**CONFIG, "deepstack_visual_indexes": [3]})
    with pytest.raises(ValueError, match="rope_type"):
        VisionArgs.from_hf({**CONFIG, "rope_parameters": {"rope_type": "default"}})


def test_reset_parameters_follows_transformers_init():
    encoder = Qwen3VisionEncoder(VisionArgs.from_hf({**CONFIG, "hidden_size": 64, "intermediate_size": 256}))
    encoder.reset_parameters(0.02, torch.Generator().manual_seed(0))
    state = encoder.state_dict()
    for name, value in state.items():
        if ".norm" in name:
            assert torch.equal(value, torch.ones_like(value) if name.endswith("weight") else torch.zeros_like(value))
        elif name.endswith("bias"):
            assert not value.any(), name
    weights = torch.cat([state[name].flatten() for name in state if "norm" not in name and name.endswith("weight")])
    assert abs(weights.mean()) < 1e-3 and abs(weights.std() - 0.02) < 1e-3
    again = Qwen3VisionEncoder(encoder.args)
    again.reset_parameters(0.02, torch.Generator().manual_seed(0))
    assert all(torch.equal(value, again.state_dict()[name]) for name, value in state.items())
