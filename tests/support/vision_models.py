"""Tiny vision-language models (Qwen3-VL, Qwen2.5-VL) for the parity and training tests, and images to feed them.

`vl_config` gives a family's config.json (transformers' spelling: Qwen3-VL nested, Qwen2.5-VL flat as the hub's);
`write_servable_vl_model` writes a random checkpoint with what `tandem sft` needs beside it: the tiny tokenizer with
the vision tokens added, a chat template that writes `<|vision_start|><|image_pad|><|vision_end|>` for an image
part, and transformers' Qwen2-VL image processor config (4 x 4 pixel patches, 2 x 2 merged).
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

from tandem.testing.tiny import SPECIAL_TOKENS, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
TEXT = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
}  # fmt: skip
VISION = {
    "depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "in_channels": 3, "patch_size": 4,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
}  # fmt: skip
FAMILIES = ("qwen3-vl", "qwen3-vl-moe", "qwen2.5-vl")
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with image parts as Qwen-VL's templates write them."""


def vl_config(family: str, vocab_size: int, image: int, video: int, start: int, end: int) -> dict[str, Any]:
    tokens = {"image_token_id": image, "video_token_id": video, "vision_start_token_id": start,
              "vision_end_token_id": end}  # fmt: skip
    if family in ("qwen3-vl", "qwen3-vl-moe"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        moe = family == "qwen3-vl-moe"
        text = {**TEXT, "vocab_size": vocab_size, "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text",
                "rope_parameters": rope}  # fmt: skip
        if moe:  # 4 experts of 24, top 2, every layer
            text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
        return {
            "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl_moe" if moe else "qwen3_vl", **tokens, "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": {**VISION, "model_type": "qwen3_vl_moe" if moe else "qwen3_vl", "num_position_embeddings": 16,
                              "deepstack_visual_indexes": [0, 2], "hidden_act": "gelu_pytorch_tanh"},
        }  # fmt: skip
    return {  # the hub's flat layout (text keys at the top, rope_scaling "mrope"), as Qwen2.5-VL is published
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **tokens, **TEXT,
        "vocab_size": vocab_size, "tie_word_embeddings": False, "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {**VISION, "model_type": "qwen2_5_vl", "depth": 4, "fullatt_block_indexes": [1, 3],
                          "window_size": 16, "hidden_act": "silu"},
    }  # fmt: skip


def write_hf_vl_model(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random transformers model of `config` (biases and norms perturbed so parity covers them), saved to
    `path` with `config` written back as given."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model_class = getattr(transformers, config["architectures"][0])
        hf = model_class(transformers.AutoConfig.for_model(**config)).float()
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith(".bias") or "norm" in name:  # transformers starts them at 0 / 1
                    param.add_(torch.randn_like(param), alpha=0.1)
    hf.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_servable_vl_model(path: Path, family: str = "qwen3-vl", seed: int = 0) -> Path:
    """`write_hf_vl_model` with the tiny tokenizer (vision tokens added), a chat template for image parts and an
    image processor config beside it."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(VISION_TOKENS)
    start, image, end = (tokenizer.token_to_id(t) for t in VISION_TOKENS)
    config = vl_config(family, tokenizer.get_vocab_size(), image, image + 100, start, end)
    write_hf_vl_model(path, config, seed)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": SPECIAL_TOKENS[0], "chat_template": VL_CHAT_TEMPLATE, "model_max_length": 2048,
    }  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 64, "longest_edge": 64 * 64}, "do_resize": True, "do_rescale": True,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    }  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def image_data_url(color: tuple[int, int, int], size: tuple[int, int] = (16, 16), shape: str = "square") -> str:
    """A PNG data URL: a `color` square (or disc) on white, `size` pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    box = (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if shape == "disc" else draw.rectangle)(box, fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def png_header(width: int, height: int) -> str:
    """A data URL of a PNG header claiming `width` x `height` pixels, with no pixel data: decoding it fails as
    truncated, so a refusal naming a pixel limit shows nothing was decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def tower_pair(hf_tower: type, config: Any, ours: type, args: type) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' vision tower `hf_tower` of `config` (eager attention, fp32) with every parameter perturbed, so
    biases and norms matter, and tandem's `ours(args.from_hf(...))` holding the same weights; both in eval mode."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    hf = hf_tower(config).float().eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.1 * torch.randn_like(param))
    tower = ours(args.from_hf(config.to_dict())).eval()
    tower.load_state_dict(hf.state_dict(), strict=True)
    return hf, tower


def tower_pixels(grid_thw: torch.Tensor, patch_dim: int, seed: int = 1) -> torch.Tensor:
    """Random patch rows for images of patch grids `grid_thw` `[N, 3]`."""
    rows = int(grid_thw.prod(dim=-1).sum())
    return torch.randn(rows, patch_dim, generator=torch.Generator().manual_seed(seed))
