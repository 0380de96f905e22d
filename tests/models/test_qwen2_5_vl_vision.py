"""Qwen2.5-VL's vision encoder against transformers' `Qwen2_5_VisionTransformerPretrainedModel` in fp32, on a tiny
random model whose windows (2 x 2 merge blocks, 4 x 4 patches) split the test images."""

from __future__ import annotations

import itertools

import pytest
import torch

from support.vision_models import tower_pair, tower_pixels
from tandem.models.layers.qwen2_5_vision import Qwen2_5VisionArgs, Qwen2_5VisionEncoder, window_layout
from tandem.models.layers.vision import merged_tokens

CONFIG = {
    "depth": 4,
    "fullatt_block_indexes": [1, 3],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "window_size": 16,  # 16 // 2 // 4 = 2 merge blocks a side
    "out_hidden_size": 24,
}
# t, h, w in patches: 2 x 2 whole windows; 3 x 5 blocks (ragged bottom and right); a two-frame video of 2 x 3 blocks
# (ragged right); one block, smaller than a window; 6 x 1 blocks (ragged right, three windows tall).
GRID = [[1, 8, 8], [1, 6, 10], [2, 4, 6], [1, 2, 2], [1, 12, 2]]
TOL = 1e-5


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, Qwen2_5VisionEncoder]:
    """The HF model with every parameter perturbed (so biases and norms matter), and tandem's with its weights."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return tower_pair(
        Qwen2_5_VisionTransformerPretrainedModel,
        Qwen2_5_VLVisionConfig(**CONFIG),
        Qwen2_5VisionEncoder,
        Qwen2_5VisionArgs,
    )


def test_parameter_names_match_the_checkpoint():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {"hidden_size": 24, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = Qwen2_5_VLConfig(text_config={**text, "num_key_value_heads": 1, "vocab_size": 64}, vision_config=CONFIG)
    state = Qwen2_5_VLForConditionalGeneration(config).state_dict()
    visual = {k.removeprefix("model.visual."): v for k, v in state.items() if k.startswith("model.visual.")}
    ours = Qwen2_5VisionEncoder(Qwen2_5VisionArgs.from_hf(CONFIG))
    ours.load_state_dict(visual, strict=True)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_matches_transformers(models, attn_implementation):
    hf, ours = models
    hf.set_attn_implementation(attn_implementation)
    grid_thw = torch.tensor(GRID)
    pixels = tower_pixels(grid_thw, ours.args.patch_dim)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid_thw).pooler_output
        merged, deepstack = ours(pixels, grid_thw)
    assert merged.shape == expected.shape == (int(merged_tokens(grid_thw, 2).sum()), 24)
    assert (merged - expected).abs().max() < TOL
    assert deepstack == []


def test_windows_are_transformers_windows():
    """The same sets of merge blocks attend together in the windowed layers, only listed in another order."""
    from transformers.vision_utils import get_vision_window_index

    grid_thw = torch.tensor(GRID)
    order, runs = window_layout(grid_thw, spatial_merge_size=2, window_blocks=2)
    index, cu_seqlens = get_vision_window_index(grid_thw, spatial_merge_size=2, window_size=16, patch_size=4)
    assert sorted(order.tolist()) == sorted(index.tolist()) == list(range(int(merged_tokens(grid_thw, 2).sum())))
    bounds = (cu_seqlens // 4).tolist()
    expected = {frozenset(index[a:b].tolist()) for a, b in itertools.pairwise(bounds)}
    got, start = set(), 0
    for windows, patches in runs:
        for _ in range(windows):
            got.add(frozenset(order[start : start + patches // 4].tolist()))
            start += patches // 4
    assert start == len(order) and got == expected
    assert len(got) == 4 + 6 + 2 * 2 + 1 + 3  # the windows do split the images
    # (windows, patches each): within a frame the largest windows first, so equal windows are consecutive, and
    # runs of equal windows join across frames and images.
    assert runs == [(6, 16), (3, 8), (1, 4), (1, 16), (1, 8), (1, 16), (1, 8), (1, 4), (3, 8)]


def test_each_image_alone_equals_its_slice(models):
    _, ours = models
    grid_thw = torch.tensor(GRID)
    pixels = tower_pixels(grid_thw, ours.args.patch_dim)
    tokens = merged_tokens(grid_thw, 2).tolist()
    with torch.no_grad():
        merged, _ = ours(pixels, grid_thw)
        start = 0
        for i, count in enumerate(tokens):
            alone, _ = ours(pixels[4 * start : 4 * (start + count)], grid_thw[i : i + 1])
            assert (alone - merged[start : start + count]).abs().max() < TOL
            start += count


def test_from_hf_defaults_and_rejections():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    args = Qwen2_5VisionArgs.from_hf({})
    assert args == Qwen2_5VisionArgs.from_hf(Qwen2_5_VLVisionConfig().to_dict())
    assert (args.depth, args.hidden_size, args.intermediate_size, args.num_heads) == (32, 3584, 3420, 16)
    assert (args.patch_size, args.window_size, args.window_blocks, args.out_hidden_size) == (14, 112, 4, 3584)
    assert args.fullatt_block_indexes == (7, 15, 23, 31) and args.hidden_act == "silu" and args.rope_theta == 1e4
    rope = {"rope_type": "axial", "rope_theta": 5.0}
    assert Qwen2_5VisionArgs.from_hf({**CONFIG, "rope_parameters": rope}).rope_theta == 5
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu'"):
        Qwen2_5VisionArgs.from_hf({**CONFIG, "hidden_act": "quick_gelu"})
    with pytest.raises(ValueError, match="window_size 4"):
        Qwen2_5VisionArgs.from_hf({**CONFIG, "window_size": 4})
    with pytest.raises(ValueError, match="rope_type"):
        Qwen2_5VisionArgs.from_hf({**CONFIG, "rope_parameters": {"rope_type": "default"}})


def test_reset_parameters_follows_transformers_init():
    encoder = Qwen2_5VisionEncoder(Qwen2_5VisionArgs.from_hf({**CONFIG, "hidden_size": 64, "intermediate_size": 256}))
    encoder.reset_parameters(0.02, torch.Generator().manual_seed(0))
    state = encoder.state_dict()
    for name, value in state.items():
        if "norm" in name or "ln_q" in name:
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("bias"):
            assert not value.any(), name
    weights = [v.flatten() for n, v in state.items() if "norm" not in n and "ln_q" not in n and n.endswith("weight")]
    weights = torch.cat(weights)
    assert abs(weights.mean()) < 1e-3 and abs(weights.std() - 0.02) < 1e-3
    again = Qwen2_5VisionEncoder(encoder.args)
    again.reset_parameters(0.02, torch.Generator().manual_seed(0))
    assert all(torch.equal(value, again.state_dict()[name]) for name, value in state.items())
