"""Images carried inline in chat messages, as OpenAI's content parts, and read into pixels only where a model needs
them (the trainer, the inference server).

A message's `content` may be a list of parts: `{"type": "text", "text": ...}` and `{"type": "image_url",
"image_url": {"url": REF}}` (OpenAI's) or `{"type": "image", "image": REF}`. REF is a data URL
(`data:image/png;base64,...`) or a local file path; rollouts, datasets and batches carry REF itself, never pixel
tensors, so every process reads the same bytes. A server takes data URLs only (it reads no files a request names):
`inline_images` turns the files an environment or dataset names into data URLs before a prompt is sent. Remote
URLs are refused: a trainer must not fetch what a rollout saw from a server that may have changed it since.

`read_image` checks before it decodes: the size of the encoded bytes, the format, the pixel count from the
header; a bad image is an `ImageError` naming what is wrong. `PixelEncoder` bounds what decoding holds: it checks
every image's header (and, for a server's request, their pixels together) before it decodes any, then decodes one
image at a time straight to the size the model's image processor would resize it to (JPEG at a reduced scale
already in the decoder), so no image larger than what the model uses is kept. Pillow is needed only here (`pip
install tandem[vision]`).
"""

from __future__ import annotations

import base64
import binascii
import io
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

MAX_IMAGE_BYTES = 20 * 2**20
"""Largest encoded image (data URL payload or file)."""
MAX_IMAGE_PIXELS = 40_000_000
"""Largest image by width x height, checked from the header before the pixels are decoded (a server may set a
lower limit, never a higher one: the trainer reads every image a rollout saw)."""
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """An image reference or image that cannot be used; the message says why."""


def image_refs(messages: Any) -> list[str]:
    """The image references of chat `messages`, in order (parts of list contents)."""
    return [ref for message in messages or () for ref in _message_refs(message)]


def _message_refs(message: Any) -> Iterator[str]:
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list):
        return
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in ("image_url", "image"):
            continue
        ref = part.get("image_url", {}).get("url") if part["type"] == "image_url" else part.get("image")
        if not isinstance(ref, str) or not ref:
            raise ImageError(f"an {part['type']} part needs a data URL or a file path, got {ref!r}")
        yield ref


def inline_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every image part a data URL: a local file an environment or dataset names is read here (a
    server takes data URLs only, and reads no files); data URLs and text pass unchanged."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not image_refs([message]):
            out.append(message)
            continue
        parts = []
        for part in content:
            ref = _message_refs({"content": [part]})
            url = next(ref, None)
            if url is None or url.startswith("data:"):
                parts.append(part)
            else:
                parts.append({"type": "image_url", "image_url": {"url": data_url(url)}})
        out.append({**message, "content": parts})
    return out


def data_url(ref: str, root: Path | None = None) -> str:
    """Image `ref` (a file, or already a data URL) as a base64 data URL of its own format, checked as `read_image`
    checks it."""
    if ref.startswith("data:"):
        return ref
    data = read_image_bytes(ref, root)
    image_format = _open(data).format or "png"
    return f"data:image/{image_format.lower()};base64," + base64.b64encode(data).decode()


def read_image_bytes(ref: str, root: Path | None = None) -> bytes:
    """The encoded bytes of `ref`: a data URL's payload, or a file (inside `root` when given)."""
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if not header.endswith(";base64"):
            raise ImageError("an image data URL must be base64 (data:image/...;base64,...)")
        if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
            raise ImageError(f"the image is over {MAX_IMAGE_BYTES // 2**20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the image data URL is not valid base64") from None
    if "://" in ref:
        raise ImageError(f"remote image URLs are refused ({ref.split('://')[0]}://...): send a data URL")
    path = Path(ref).expanduser()
    if root is not None:
        path = (root / path).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ImageError(f"image path {ref} lies outside {root}")
    if not path.is_file():
        raise ImageError(f"image file {ref} does not exist")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise ImageError(f"image file {ref} is over {MAX_IMAGE_BYTES // 2**20} MiB")
    return path.read_bytes()


def read_image(ref: str, root: Path | None = None) -> Any:
    """`ref` decoded as an RGB `PIL.Image`, after checking its size and format."""
    return _decode(_open(read_image_bytes(ref, root)))


def _decode(image: Any, size: tuple[int, int] | None = None, resample: int = 3) -> Any:
    """The opened `image` decoded as RGB, scaled to `size` (width, height) with `resample` (PIL's, default
    bicubic) where that is smaller: a JPEG is decoded at the smallest reduced scale (1/2, 1/4, 1/8) still at least
    `size` (Pillow's `draft`), others in full and resized at once, so only the scaled copy is kept."""
    try:
        if size is not None and size[0] * size[1] < image.width * image.height:
            image.draft("RGB", size)  # a no-op for formats other than JPEG
            scaled = image.convert("RGB")
            image.close()
            return scaled if scaled.size == size else scaled.resize(size, resample)
        return image.convert("RGB")
    except (OSError, ValueError):
        raise ImageError("the image bytes are truncated or corrupt") from None


def _open(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The image in `data`, its header read and checked (format, at most `max_pixels`); its pixels not decoded
    yet."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ImageError("images need Pillow: pip install 'tandem[vision]'") from None
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # Pillow's own cap, far above MAX_IMAGE_PIXELS
        raise ImageError(f"the image has far more than {max_pixels:,} pixels (max_image_pixels)") from None
    except (UnidentifiedImageError, OSError):
        raise ImageError("the image bytes are not an image Pillow can read") from None
    if image.format not in FORMATS:
        raise ImageError(f"image format {image.format} is not supported ({', '.join(FORMATS)})")
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"the image is {width} x {height} pixels, over the limit of {max_pixels:,} pixels (max_image_pixels)"
        )
    return image


class PixelEncoder:
    """A vision-language model's image processor (transformers', from the model directory's
    `preprocessor_config.json`): image references -> pixel patches `[P, C * T * p * p]` and (t, h, w) patch grids
    `[N, 3]`, and how many placeholder tokens each image takes (one per `merge_size` x `merge_size` patches).

    Images are decoded one at a time, each straight to the size the processor resizes it to (its own rule, e.g.
    Qwen-VL's `smart_resize` to at most `size["longest_edge"]` pixels), so the processor gets what it would have
    made of the full image (the same pixels, for transformers' PIL processors) and nothing larger is held. The
    trainers and the server encode through this one path, so they see the same pixels."""

    def __init__(
        self, model_dir: str | Path, root: Path | None = None, max_image_pixels: int = MAX_IMAGE_PIXELS
    ) -> None:
        from transformers import AutoImageProcessor

        if not 0 < max_image_pixels <= MAX_IMAGE_PIXELS:
            raise ValueError(f"max_image_pixels must be in 1..{MAX_IMAGE_PIXELS:,}, got {max_image_pixels:,}")
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as error:
            raise ImageError(f"{model_dir} has no image processor (preprocessor_config.json): {error}") from None
        self.merge = int(getattr(self.processor, "merge_size", 2))
        self.root = root
        self.max_image_pixels = max_image_pixels
        self._target = _resize_rule(self.processor)

    def check(
        self, refs: list[str], max_total_pixels: int | None = None, stop: Callable[[], bool] | None = None
    ) -> int:
        """The pixels of the images `refs` together, from their headers (none is decoded); ImageError for an
        unreadable or too large image, or when they have more than `max_total_pixels` together. `stop`: asked
        before each image; when it says so, ImageError."""
        total = 0
        for ref in refs:
            _check_stop(stop)
            with self._open(ref) as image:
                total += image.width * image.height
        if max_total_pixels is not None and total > max_total_pixels:
            raise ImageError(
                f"the {len(refs)} images have {total:,} pixels together, over the limit of {max_total_pixels:,} "
                "pixels a request (max_request_image_pixels)"
            )
        return total

    def encode(self, refs: list[str], stop: Callable[[], bool] | None = None) -> tuple[Any, Any]:
        """(pixel_values, image_grid_thw) of the images `refs`, in order: every header checked first, then one
        image decoded and processed at a time. `stop`: asked before each image; when it says so, ImageError."""
        import torch

        self.check(refs, stop=stop)  # every image's header before any image's pixels
        values, grids = [], []
        for ref in refs:
            _check_stop(stop)
            out = self.processor(images=[self.read(ref)], return_tensors="pt")
            values.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
        return torch.cat(values), torch.cat(grids)

    def read(self, ref: str) -> Any:
        """Image `ref` decoded as RGB at the size the processor resizes it to, where that is smaller."""
        image = self._open(ref)
        try:
            size = self._target(image.width, image.height) if self._target is not None else None
        except ValueError as error:  # e.g. an aspect ratio the processor refuses
            raise ImageError(f"the image is {image.width} x {image.height} pixels: {error}") from None
        return _decode(image, size, getattr(self.processor, "resample", 3))

    def placeholders(self, ref: str) -> int:
        """Placeholder tokens image `ref` takes: its merged patches, from its size (the processor's own rule,
        `get_number_of_image_patches`, the one vLLM uses). The image is decoded, so a corrupt one fails here, but
        not normalised into patches."""
        image = self.read(ref)
        count = getattr(self.processor, "get_number_of_image_patches", None)
        if count is None:  # a processor without the rule: encode the image and read its grid
            patches = int(self.processor(images=[image], return_tensors="pt")["image_grid_thw"].prod())
        else:
            patches = count(image.height, image.width)
        return patches // self.merge**2

    def _open(self, ref: str) -> Any:
        return _open(read_image_bytes(ref, self.root), self.max_image_pixels)


def _check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise ImageError("image work stopped (the request was cancelled or the server is stopping)")


def _resize_rule(processor: Any) -> Callable[[int, int], tuple[int, int]] | None:
    """(width, height) -> the (width, height) `processor` resizes an image of that size to: Qwen-VL's
    `smart_resize` (as defined or imported by the processor's own module) with the processor's patch, merge and
    pixel bounds; None for a processor without that rule or that does not resize (images are then decoded in
    full and left to it)."""
    rule = getattr(sys.modules.get(type(processor).__module__), "smart_resize", None)
    size = getattr(processor, "size", None)
    try:
        factor = int(processor.patch_size) * int(processor.merge_size)
        min_pixels, max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])  # type: ignore[index]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if rule is None or not getattr(processor, "do_resize", True):
        return None

    def target(width: int, height: int) -> tuple[int, int]:
        resized_height, resized_width = rule(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        return int(resized_width), int(resized_height)

    return target
