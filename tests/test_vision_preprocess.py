"""Image preprocessing (SPEC §7): the released token counts, the resize rule, chessboard compositing after the
resize, normalisation and padding, patch layout, accepted sources and clear errors for bad ones."""
import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3.vision.config import VisionConfig
from k3.vision.preprocess import (ImageError, load_image, num_image_tokens, padded_size, preprocess_image,
                                  resize_size)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("size, tokens", [((28, 28), 1), ((640, 480), 414), ((1920, 1080), 2691),
                                          ((4000, 3000), 15444), ((8192, 8192), 16384), ((1861, 7041), 16817)])
def test_token_counts_of_the_spec_examples(size, tokens):
    assert num_image_tokens(*size) == tokens


@pytest.mark.parametrize("W, H", [(28, 28), (640, 480), (1920, 1080), (8192, 8192), (1861, 7041), (30, 5000)])
def test_resize_rule_limits_and_never_upscales(W, H):
    w, h = resize_size(W, H)
    assert w <= W and h <= H                                  # never upscale
    assert w <= 512 * 14 and h <= 512 * 14                    # patch_limit_on_one_side
    # one scale for both sides (aspect kept to within the int() truncation); the patch budget is met up to the
    # floor in W//14 (1861x7041 → 16,817 tokens, slightly over 65,536/4, as the released rule gives)
    assert abs(w / W - h / H) <= 1 / min(W, H) + 1 / min(w, h)
    assert (w // 14) * (h // 14) <= 65536 * 1.02
    pw, ph = padded_size(W, H)
    assert pw % 28 == 0 and ph % 28 == 0 and pw - w < 28 and ph - h < 28


@pytest.mark.parametrize("W, H", [(28, 28), (30, 50), (100, 61), (57, 29)])
def test_pad_count_equals_merged_patch_count(W, H):
    rng = np.random.default_rng(W * H)
    img = Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), "RGB")
    x = preprocess_image(png_bytes(img))
    t, h, w = x.grid_thw
    assert x.pixel_values.shape == (h * w, 3, 14, 14)
    assert x.num_tokens == (h // 2) * (w // 2) == x.pixel_values.shape[0] // 4 == num_image_tokens(W, H)
    assert x.size == (W, H) and x.resized == (W, H)


def test_normalisation_padding_and_patch_layout():
    # 30 x 20 image whose pixel (y, x) channel c holds a distinct value: checks row-major, channel-first patches.
    H, W = 20, 30
    y, x = np.mgrid[0:H, 0:W]
    arr = np.stack([(x * 7 + y) % 256, (y * 11 + 3) % 256, (x + y * 5) % 256], -1).astype(np.uint8)
    out = preprocess_image(Image.fromarray(arr, "RGB"))
    assert out.grid_thw == (1, 2, 4)  # padded to 56 x 28 → 4 × 2 patches
    canvas = np.zeros((28, 56, 3), np.uint8)
    canvas[:H, :W] = arr
    expect = canvas.astype(np.float64) / 255 * 2 - 1  # padded pixels are zero bytes → −1
    for r in range(2):
        for c in range(4):
            patch = expect[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].transpose(2, 0, 1)
            got = out.pixel_values[r * 4 + c].double().numpy()
            assert np.allclose(got, patch, atol=1e-6), (r, c)


def test_transparent_image_is_composited_onto_the_chessboard_after_the_resize():
    # A fully transparent 112 × 112 image shrunk 2× by a small patch budget: squares are 8 px in the *resized* frame.
    cfg = VisionConfig.preset("tiny").replace(media_proc_cfg={"in_patch_limit": 16, "patch_limit_on_one_side": 64})
    img = Image.new("RGBA", (112, 112), (10, 200, 30, 0))
    out = preprocess_image(img, cfg)
    assert out.resized == (56, 56)
    px = ((out.pixel_values.reshape(4, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 56, 56) + 1) / 2 * 255).round()
    for (yy, xx) in [(0, 0), (3, 5), (8, 8), (20, 17), (55, 55)]:
        want = 255 if ((yy // 8) + (xx // 8)) % 2 == 0 else 180
        assert px[:, yy, xx].tolist() == [want] * 3, (yy, xx)
    # an opaque RGBA image keeps its colour
    solid = preprocess_image(Image.new("RGBA", (28, 28), (10, 200, 30, 255)), cfg)
    assert torch.allclose(solid.pixel_values[0, :, 0, 0], torch.tensor([10, 200, 30]) / 255 * 2 - 1, atol=1e-6)


def test_sources_bytes_file_and_data_url_agree(tmp_path):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8), "RGB")
    data = png_bytes(img)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    outs = [preprocess_image(s) for s in (data, path, str(path), url, img)]
    assert len({o.digest for o in outs}) == 1
    for o in outs[1:]:
        assert torch.equal(o.pixel_values, outs[0].pixel_values)


@pytest.mark.parametrize("source, match", [
    ("https://example.com/cat.png", "remote"),
    ("data:image/png;base64,@@@not-base64@@@", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "image/"),
    (b"", "empty"),
    (b"definitely not an image", "could not be decoded"),
    (12345, "must be bytes, a file path"),
    ("/nonexistent/dir/img.png", "not found"),
])
def test_bad_sources_raise_clear_errors(source, match):
    with pytest.raises(ImageError, match=match):
        load_image(source)


def test_truncated_file_and_absurd_sizes_are_refused():
    data = png_bytes(Image.new("RGB", (64, 64), (1, 2, 3)))
    with pytest.raises(ImageError, match="could not be decoded"):
        load_image(data[: len(data) // 2])
    with pytest.raises(ImageError, match="aspect ratio"):
        load_image(png_bytes(Image.new("RGB", (1, 300))))
    with pytest.raises(ImageError, match="zero-size"):
        resize_size(0, 10)
    assert issubclass(ImageError, ValueError)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_photo_stored_sideways_is_read_upright(fmt):
    """EXIF Orientation 6 (a phone held upright: rotate 90° clockwise to view): stored 40 wide and 20 high with a red
    top-left corner, the image is 20 wide and 40 high with that corner at the top right, from bytes and data URL
    alike; an EXIF block without an orientation leaves the pixels as stored."""
    stored = np.zeros((20, 40, 3), dtype=np.uint8)
    stored[:6, :6] = (255, 0, 0)
    img = Image.fromarray(stored)
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, format=fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    for source in (buf.getvalue(), "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()):
        up = np.asarray(load_image(source).convert("RGB"))
        assert up.shape == (40, 20, 3)
        assert up[:3, -3:, 0].min() > 200 and up[:3, :3, 0].max() < 60  # red at the top right, not the top left
        assert up[-3:, -3:, 0].max() < 60
    assert preprocess_image(buf.getvalue()).size == (20, 40)
    plain = io.BytesIO()
    exif[0x0112] = 1
    img.save(plain, format=fmt, exif=exif.tobytes())
    assert np.asarray(load_image(plain.getvalue()).convert("RGB")).shape == (20, 40, 3)
