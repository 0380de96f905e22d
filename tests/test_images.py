"""Image references in chat messages (`tandem.images`): what is read, and every bad image refused by name before
its pixels are decoded."""

from __future__ import annotations

import base64
import io

import pytest

from tandem.images import MAX_IMAGE_PIXELS, ImageError, image_refs, read_image, read_image_bytes

Image = pytest.importorskip("PIL.Image", reason="images need Pillow")


def _data_url(image, format: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def test_refs_come_from_both_part_spellings_in_order():
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "assistant", "content": "plain text"},
    ]  # fmt: skip
    assert image_refs(messages) == ["a.png", "data:image/png;base64,AA=="]
    with pytest.raises(ImageError, match="needs a data URL or a file path"):
        image_refs([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_data_urls_and_files_read_as_rgb(tmp_path):
    red = Image.new("RGBA", (5, 3), (255, 0, 0, 255))
    assert read_image(_data_url(red)).mode == "RGB" and read_image(_data_url(red, "JPEG" if False else "PNG")).size == (
        5,
        3,
    )
    red.convert("RGB").save(tmp_path / "red.jpg")
    assert read_image("red.jpg", root=tmp_path).size == (5, 3)


def test_bad_images_are_refused_by_name(tmp_path):
    with pytest.raises(ImageError, match="remote image URLs are refused"):
        read_image("https://example.com/a.png")
    with pytest.raises(ImageError, match="not valid base64"):
        read_image("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="must be base64"):
        read_image("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="not an image Pillow can read"):
        read_image("data:image/png;base64," + base64.b64encode(b"not an image").decode())
    png = base64.b64decode(_data_url(Image.new("RGB", (40, 40), (9, 99, 199))).partition(",")[2])
    with pytest.raises(ImageError, match="truncated or corrupt"):
        read_image("data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode())
    with pytest.raises(ImageError, match="format TIFF is not supported"):
        read_image(_data_url(Image.new("RGB", (4, 4)), "TIFF"))
    (tmp_path / "inside").mkdir()
    (tmp_path / "secret.png").write_bytes(b"x")
    with pytest.raises(ImageError, match="lies outside"):
        read_image_bytes("../secret.png", root=tmp_path / "inside")
    with pytest.raises(ImageError, match="does not exist"):
        read_image("missing.png", root=tmp_path)


def test_a_huge_image_is_refused_from_its_header():
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    huge = Image.new("1", (side, side))  # 1 bit a pixel: a small file of many pixels
    with pytest.raises(ImageError, match="pixels, over"):
        read_image(_data_url(huge))


def test_files_are_inlined_as_data_urls_for_a_server(tmp_path):
    """What an environment or dataset names as a file goes to a server as a data URL of the same bytes."""
    from tandem.images import data_url, inline_images

    Image.new("RGB", (6, 4), (1, 2, 3)).save(tmp_path / "a.png")
    url = data_url(str(tmp_path / "a.png"))
    assert url.startswith("data:image/png;base64,") and read_image(url).getpixel((0, 0)) == (1, 2, 3)
    assert base64.b64decode(url.partition(",")[2]) == (tmp_path / "a.png").read_bytes()
    messages = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")},
                                             {"type": "text", "text": "hi"}]}, {"role": "user", "content": "plain"}]  # fmt: skip
    inlined = inline_images(messages)
    assert image_refs(inlined) == [url] and inlined[0]["content"][1] == {"type": "text", "text": "hi"}
    assert inlined[1] is messages[1] and image_refs(messages) == [str(tmp_path / "a.png")]  # the input unchanged


def test_a_header_beyond_pillows_own_cap_is_an_image_error():
    """A few bytes of PNG whose header claims 20000 x 20000 pixels: Pillow's decompression-bomb error becomes an
    ImageError (a 400 on a server, a skipped row in SFT), never an unhandled exception."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    with pytest.raises(ImageError, match="far more than"):
        read_image("data:image/png;base64," + base64.b64encode(png).decode())


@pytest.mark.parametrize("family", ["qwen3-vl", "qwen2.5-vl"])
def test_placeholders_from_the_size_match_the_encoded_grid(family, tmp_path):
    """`PixelEncoder.placeholders` counts from the image's size; the processor's patch grid of the same image agrees,
    for sizes it resizes up, keeps and rounds (odd, wide, tall)."""
    from support.vision_models import image_data_url, write_servable_vl_model
    from tandem.images import PixelEncoder

    pixels = PixelEncoder(write_servable_vl_model(tmp_path, family))
    for size in [(16, 16), (24, 16), (37, 101), (130, 9), (300, 200)]:
        ref = image_data_url((10, 200, 10), size)
        _, grid = pixels.encode([ref])
        assert pixels.placeholders(ref) == int(grid.prod()) // pixels.merge**2, size


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from support.vision_models import write_servable_vl_model

    return write_servable_vl_model(tmp_path_factory.mktemp("qwen3-vl"))


def test_pixel_limits_are_checked_from_the_headers_before_anything_is_decoded(vl_dir):
    """Each image's limit (set lower than the trainers') and a request's total, each named in the refusal."""
    from support.vision_models import png_header
    from tandem.images import PixelEncoder

    pixels = PixelEncoder(vl_dir, max_image_pixels=1_000_000)
    with pytest.raises(
        ImageError, match=r"1000 x 1001 pixels, over the limit of 1,000,000 pixels \(max_image_pixels\)"
    ):
        pixels.encode([png_header(1000, 1001)])
    claims = [png_header(1000, 1000)] * 3  # each within the limit, 3,000,000 together
    assert pixels.check(claims) == 3_000_000
    with pytest.raises(ImageError, match=r"3,000,000 pixels together, over the limit of 2,000,000 .*max_request_image"):
        pixels.check(claims, max_total_pixels=2_000_000)
    with pytest.raises(ImageError, match="truncated or corrupt"):  # what decoding such a header gives
        pixels.encode(claims[:1])
    with pytest.raises(ValueError, match="max_image_pixels must be in"):
        PixelEncoder(vl_dir, max_image_pixels=MAX_IMAGE_PIXELS + 1)


@pytest.mark.parametrize("image_format", ["PNG", "JPEG"])
def test_large_images_are_scaled_to_what_the_model_uses_while_decoding(vl_dir, image_format, monkeypatch):
    """A large image reaches the processor already at the size the processor resizes it to (at most its
    `longest_edge` pixels; a JPEG decoded at 1/8 scale by the decoder itself), one image at a time, and gives the
    patches the processor makes of the full image: the same values for a PNG, the same grid for a JPEG."""
    from PIL import ImageDraw, JpegImagePlugin

    from tandem.images import PixelEncoder

    pixels = PixelEncoder(vl_dir)
    big = Image.new("RGB", (3000, 2000), (255, 255, 255))
    ImageDraw.Draw(big).ellipse((300, 200, 2400, 1800), fill=(20, 120, 220))
    refs = [_data_url(big, image_format), _data_url(Image.new("RGB", (20, 12), (5, 6, 7)), image_format)]
    seen: list[tuple[int, int]] = []
    drafts: list[tuple[int, int]] = []
    processor = pixels.processor

    def recording(images, **kwargs):
        seen.extend(image.size for image in images)
        return processor(images=images, **kwargs)

    draft = JpegImagePlugin.JpegImageFile.draft

    def recording_draft(self, mode, size):
        out = draft(self, mode, size)
        drafts.append(self.size)
        return out

    monkeypatch.setattr(pixels, "processor", recording)
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", recording_draft)
    values, grid = pixels.encode(refs)
    longest = processor.size["longest_edge"]
    assert len(seen) == 2 and seen[0][0] * seen[0][1] <= longest < 3000 * 2000 and seen[1] == (20, 12)
    assert drafts == ([(375, 250)] if image_format == "JPEG" else [])  # 1/8 of 3000 x 2000, still over the target
    whole = processor(images=[read_image(ref) for ref in refs], return_tensors="pt")
    assert torch_equal(grid, whole["image_grid_thw"])
    if image_format == "PNG":
        assert torch_equal(values, whole["pixel_values"])
    assert pixels.placeholders(refs[0]) == int(grid[0].prod()) // pixels.merge**2


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_encoding_stops_between_images_when_asked(vl_dir):
    from support.vision_models import image_data_url
    from tandem.images import PixelEncoder

    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3  # two headers checked, the first image encoded, then stop

    with pytest.raises(ImageError, match="image work stopped"):
        PixelEncoder(vl_dir).encode([image_data_url((1, 2, 3))] * 2, stop)
    assert len(asked) == 4
