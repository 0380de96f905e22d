"""Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL against transformers (fp32): logits with images (several images of
different grids, a row without any, padded rows), text alone, M-RoPE positions with padding, a packed row of image
documents against each alone, the multimodal checkpoint written back and read by transformers, and placeholders
that do not count an image's patches refused by name.

The references are tiny random `...ForConditionalGeneration` models (`support.vision_models`); images are random
patch rows with their (t, h, w) grids, as transformers' image processor would give them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.vision_models import FAMILIES, vl_config, write_hf_vl_model
from tandem.models import load_model, save_model
from tandem.models.decoder import Images
from tandem.models.layers.rope import mrope_positions

transformers = pytest.importorskip("transformers")

IMAGE, START, END = 300, 302, 303
GRIDS = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 2, 2]])  # 4, 6 and 1 placeholder tokens
TOL = 1e-4


def _span(grid: list[int]) -> list[int]:
    t, h, w = grid
    return [START, *[IMAGE] * (t * h * w // 4), END]


def _batch() -> tuple[torch.Tensor, Images]:
    """Row 0: text, an image, text, another image, text; row 1: text, an image, text; row 2: text only."""
    g = GRIDS.tolist()
    rows = [[5, 6, *_span(g[0]), 7, 8, *_span(g[1]), 9], [10, 11, 12, *_span(g[2]), 13, 14], list(range(20, 28))]
    width = max(map(len, rows))
    ids = torch.tensor([row + list(range(40, 40 + width - len(row))) for row in rows])
    patches = int(GRIDS.prod(-1).sum())
    pixels = torch.randn(patches, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    return ids, Images(pixels, GRIDS)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Path:
    config = vl_config(request.param, 320, IMAGE, 301, START, END)
    return write_hf_vl_model(tmp_path_factory.mktemp(request.param), config)


def _hf(path: Path) -> torch.nn.Module:
    config = json.loads((path / "config.json").read_text())
    model_class = getattr(transformers, config["architectures"][0])
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, images: Images | None, mask=None) -> torch.Tensor:
    extra = {}
    if images is not None:
        types = (ids == IMAGE).int()
        extra = {"pixel_values": images.pixel_values, "image_grid_thw": images.grid_thw, "mm_token_type_ids": types}
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, **extra).logits


def test_logits_with_images_match_transformers(checkpoint):
    ids, images = _batch()
    model = load_model(checkpoint, dtype=torch.float32).eval()
    hf = _hf(checkpoint)
    with torch.no_grad():
        ours = model(ids, images=images)
        text_only = model(ids)
    want = _hf_logits(hf, ids, images)
    assert (ours - want).abs().max() < TOL
    assert (text_only - _hf_logits(hf, ids, None)).abs().max() < TOL  # the placeholders read as tokens
    assert (ours - text_only).abs().max() > 1e-2  # the images change the logits


def test_positions_match_transformers_with_padding(checkpoint):
    ids, images = _batch()
    mask = torch.ones_like(ids)
    mask[2, :3] = 0  # the text-only row left-padded
    hf = _hf(checkpoint)
    want, _ = hf.model.get_rope_index(ids, (ids == IMAGE).int(), images.grid_thw, attention_mask=mask)
    got = mrope_positions(ids, IMAGE, images.grid_thw, 2, attention_mask=mask)
    real = mask.bool()
    assert torch.equal(got[:, real], want[:, real])
    assert got[0, 0, 3:7].tolist() == [3, 3, 3, 3] and got[1, 0, 3:7].tolist() == [3, 3, 4, 4]  # the 2 x 2 grid
    assert got[2, 0, 3:7].tolist() == [3, 4, 3, 4] and got[0, 0, 7] == 3 + 2  # text resumes after max(h, w)


def test_the_multimodal_checkpoint_is_written_back(checkpoint, tmp_path):
    ids, images = _batch()
    model = load_model(checkpoint, dtype=torch.float32).eval()
    save_model(model, tmp_path / "saved")
    saved, config = (json.loads((path / "config.json").read_text()) for path in (tmp_path / "saved", checkpoint))
    assert saved["architectures"] == config["architectures"] and saved["vision_config"] == config["vision_config"]
    again = _hf(tmp_path / "saved")
    assert (_hf_logits(again, ids, images) - _hf_logits(_hf(checkpoint), ids, images)).abs().max() == 0


def test_images_that_do_not_fit_are_refused_by_name(checkpoint, tiny_model_dir):
    ids, images = _batch()
    model = load_model(checkpoint, dtype=torch.float32).eval()
    short = Images(images.pixel_values[:-4], images.grid_thw[:2])  # the last image left out
    with pytest.raises(ValueError, match="image placeholder tokens for"):
        model(ids, images=short)
    with pytest.raises(ValueError, match="takes no images"):
        load_model(tiny_model_dir("qwen3"))(ids % 300, images=images)


def test_a_packed_row_of_image_documents_equals_each_document_alone(checkpoint):
    """Two documents with images packed in one row (positions restart): each document's logits as when it runs
    alone, so SFT and RL may pack image rows."""
    ids, images = _batch()
    model = load_model(checkpoint, dtype=torch.float32).eval()
    first, second = ids[0], ids[1]
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
    split = int(images.grid_thw[:2].prod(-1).sum())  # the first row's two images, then the second row's one
    with torch.no_grad():
        packed = model(row, positions, images=images)[0]
        alone = [
            model(first[None], images=Images(images.pixel_values[:split], images.grid_thw[:2]))[0],
            model(second[None], images=Images(images.pixel_values[split : split + 4], images.grid_thw[2:]))[0],
        ]
    assert (packed - torch.cat(alone)).abs().max() < TOL


def test_padded_rows_with_images_match_transformers(checkpoint):
    """Left padding (the attention mask's zeros take no position and attend nowhere) on rows with images: the
    real tokens' logits as transformers computes them."""
    ids, images = _batch()
    pad = 3
    padded = torch.cat([torch.zeros(3, pad, dtype=torch.long), ids], dim=1)
    mask = torch.ones_like(padded)
    mask[:, :pad] = 0
    model = load_model(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(padded, mask=mask, images=images)[:, pad:]
    want = _hf_logits(_hf(checkpoint), padded, images, mask)[:, pad:]
    assert (ours - want).abs().max() < TOL


def test_lora_adapts_the_language_model_only(checkpoint):
    """LoRA targets name the language model's projections; Qwen2.5-VL's vision MLP shares their names
    (gate_proj, up_proj, down_proj) and stays unadapted."""
    from tandem.models.lora import LoraArgs, apply_lora, lora_modules

    model = load_model(checkpoint, dtype=torch.float32)
    adapted = apply_lora(model, LoraArgs(rank=4))
    assert adapted and not any(name.startswith("visual.") for name in adapted)
    assert not any(name.startswith("visual.") for name, _ in lora_modules(model))


def test_lora_adapters_load_in_peft_on_transformers_class_and_back(checkpoint, tmp_path):
    """A tandem adapter on a vision-language model is PEFT's for transformers' class (keys under
    `model.language_model.`): PEFT attaches it and computes tandem's logits with images; PEFT's own loads back."""
    peft = pytest.importorskip("peft")
    from tandem.models.lora import LoraArgs, apply_lora, load_peft_adapter, lora_parameters, save_adapter

    ids, images = _batch()
    model = load_model(checkpoint, dtype=torch.float32).eval()
    apply_lora(model, LoraArgs(rank=4, alpha=8, target_modules=("q_proj", "v_proj")), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        ours = model(ids, images=images)
    save_adapter(model, tmp_path / "adapter")
    reference = peft.PeftModel.from_pretrained(_hf(checkpoint), tmp_path / "adapter").eval()
    want = _hf_logits(reference, ids, images)
    assert (ours - want).abs().max() < TOL and (want - _hf_logits(_hf(checkpoint), ids, images)).abs().max() > 1e-3
    reference.save_pretrained(tmp_path / "from-peft")
    again = load_model(checkpoint, dtype=torch.float32).eval()
    load_peft_adapter(again, tmp_path / "from-peft")
    with torch.no_grad():
        assert (again(ids, images=images) - ours).abs().max() < TOL
