"""A vision-language prompt's images in the engine: checked and expanded when the request is submitted, encoded
once when it is first prefilled, and sliced into each prefill chunk.

The prompt comes with one image placeholder token per image (what a Qwen-VL chat template writes) and the images'
references (`tandem.images`: data URLs or, where the server allows them, files). `expand` reads and processes the
images (the model directory's image processor), makes each placeholder as many as the image's merged patches, and
computes the prompt's M-RoPE positions (`models.layers.rope.mrope_positions`): text after an image runs at its
index plus a fixed offset, which decode steps add to every generated token (`decode.decode_step`). The vision tower
runs once per request, on the engine thread (`encode`), whatever `n`: its samples fork after the prompt; the pixels
are dropped once it has, and the request keeps only the tower's features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.images import ImageError, PixelEncoder
from tandem.models import CausalLM
from tandem.models.decoder import VisualFeatures
from tandem.models.layers.rope import mrope_positions
from tandem.models.layers.vision import merged_tokens

MAX_IMAGES = 16
"""Images one request may carry."""


@dataclass
class PromptImages:
    """What a request's images add to it: pixels and grids, the expanded prompt's M-RoPE positions `[3, L]`, the
    offset of every later position, the placeholder spans (start, end) and, once encoded, the tower's features
    (and no more pixels)."""

    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor
    positions: torch.Tensor
    offset: int
    spans: list[tuple[int, int]]
    embeds: torch.Tensor | None = None
    deepstack: tuple[torch.Tensor, ...] = field(default_factory=tuple)


def expand(
    prompt: list[int],
    refs: list[str],
    pixels: PixelEncoder,
    image_token_id: int,
    stop: Callable[[], bool] | None = None,
) -> tuple[list[int], PromptImages]:
    """The prompt with each image's placeholder expanded, and its `PromptImages`; ValueError naming the problem
    (unreadable or too large image, placeholders that do not match the images, too many images). `stop`: asked
    before each image is decoded (`PixelEncoder.encode`)."""
    if len(refs) > MAX_IMAGES:
        raise ValueError(f"{len(refs)} images in one request; at most {MAX_IMAGES}")
    at = [i for i, token in enumerate(prompt) if token == image_token_id]
    if len(at) != len(refs):
        raise ValueError(f"the prompt has {len(at)} image placeholders for {len(refs)} images (one each)")
    try:
        pixel_values, grid_thw = pixels.encode(refs, stop)
    except ImageError as error:
        raise ValueError(f"bad image: {error}") from None
    counts = merged_tokens(grid_thw, pixels.merge).tolist()
    expanded: list[int] = []
    spans: list[tuple[int, int]] = []
    start = 0
    for i, count in zip(at, counts, strict=True):
        expanded += prompt[start:i]
        spans.append((len(expanded), len(expanded) + count))
        expanded += [image_token_id] * count
        start = i + 1
    expanded += prompt[start:]
    positions = mrope_positions(torch.tensor([expanded]), image_token_id, grid_thw, pixels.merge)[:, 0]
    offset = int(positions.max()) + 1 - len(expanded)
    return expanded, PromptImages(pixel_values, grid_thw, positions, offset, spans)


@torch.no_grad()
def encode(model: CausalLM, images: PromptImages) -> None:
    """Run the vision tower on the request's images (once; on the engine thread, between steps), then release
    their pixels."""
    if images.embeds is not None:
        return
    assert model.visual is not None and images.pixel_values is not None
    device = model.embed_tokens.weight.device
    embeds, deepstack = model.visual(images.pixel_values.to(device), images.grid_thw.to(device))
    images.embeds, images.deepstack, images.pixel_values = embeds, tuple(deepstack), None


def chunk_positions(images: PromptImages | None, start: int, count: int) -> torch.Tensor:
    """M-RoPE positions `[3, count]` of tokens start..start+count of a sequence: the prompt's own, then index plus
    the offset (generated tokens, re-prefilled after a preemption); plain indices without images."""
    index = torch.arange(start, start + count)
    if images is None:
        return index.expand(3, -1)
    prompt = images.positions.shape[1]
    out = (index + images.offset).expand(3, -1).clone()
    inside = index < prompt
    out[:, inside] = images.positions[:, index[inside]]
    return out


def chunk_features(images: PromptImages | None, start: int, count: int) -> tuple[list[bool], tuple[int, int] | None]:
    """Which of tokens start..start+count of a sequence are image placeholders, and the rows of the request's
    image features they take (placeholders follow feature order), or None when the chunk holds none."""
    mask = [False] * count
    if images is None:
        return mask, None
    done = 0
    first = last = None
    for span_start, span_end in images.spans:
        lo, hi = max(span_start, start), min(span_end, start + count)
        if lo < hi:
            mask[lo - start : hi - start] = [True] * (hi - lo)
            first = done + lo - span_start if first is None else first
            last = done + hi - span_start
        done += span_end - span_start
    return mask, None if first is None or last is None else (first, last)


def step_features(parts: list[tuple[PromptImages, tuple[int, int]]], mask: torch.Tensor) -> VisualFeatures:
    """The step's `VisualFeatures`: the chunks' feature rows, in packed order, for the placeholders in `mask`
    `[1, T]`."""
    embeds = torch.cat([images.embeds[a:b] for images, (a, b) in parts])  # type: ignore[index]
    layers = len(parts[0][0].deepstack)
    deepstack = tuple(torch.cat([images.deepstack[i][a:b] for images, (a, b) in parts]) for i in range(layers))
    return VisualFeatures(mask, embeds, deepstack)
