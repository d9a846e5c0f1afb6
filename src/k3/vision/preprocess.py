"""Image preprocessing (SPEC §7, `media_proc_cfg`): decode from bytes, files or base64 data URLs (turned upright by
their EXIF Orientation); the released resize rule (never upscale; patch-count and side limits); bicubic resize with
Pillow; transparency composited after the resize onto an 8-px chessboard; zero padding to multiples of 28; [-1, 1]
normalisation; NaViT-style patchify. `num_image_tokens` gives the pad count of an image from its size alone, by the
same rule."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3.vision.config import VisionConfig

MAX_ASPECT_RATIO = 200          # longer side / shorter side; beyond this an image is refused
MAX_INPUT_PIXELS = 1 << 28      # 268 M pixels decoded at most (decompression bombs)
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,(?P<data>.*)$", re.S)
_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_RELEASED = VisionConfig()


class ImageError(ValueError):
    """An image input k3 cannot use; the message says what was wrong and what is accepted."""


@dataclass
class ImageInput:
    """One preprocessed image.
    pixel_values: [N, 3, P, P] float32 in [-1, 1], patches in row-major order, each channel-first (c, y, x).
    grid_thw: (1, h, w) patches; size: the original (W, H); resized: (w, h) before padding;
    num_tokens: merged tokens = pads in the prompt; digest: sha256 of the resized pixels (prefix-cache key)."""
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    size: tuple[int, int]
    resized: tuple[int, int]
    num_tokens: int
    digest: str


# ---- the resize rule --------------------------------------------------------------------------------------
def resize_size(width: int, height: int, config: VisionConfig | None = None) -> tuple[int, int]:
    """(W, H) → the (w, h) the image is resized to: scale = min(1, s1, s2, s3) with
    s1 = sqrt(in_patch_limit / (max(1, W//P) · max(1, H//P))), s2 = max_side / W, s3 = max_side / H."""
    cfg = config or _RELEASED
    _check_size(width, height)
    p = cfg.patch_size
    s1 = math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p)))
    scale = min(1.0, s1, cfg.max_side / width, cfg.max_side / height)
    return max(1, int(width * scale)), max(1, int(height * scale))


def padded_size(width: int, height: int, config: VisionConfig | None = None) -> tuple[int, int]:
    """The resized size rounded up to multiples of patch × merge (28 px)."""
    cfg = config or _RELEASED
    w, h = resize_size(width, height, cfg)
    m = cfg.pad_multiple
    return -(-w // m) * m, -(-h // m) * m


def num_image_tokens(width: int, height: int, config: VisionConfig | None = None) -> int:
    """Merged tokens (= `<|media_pad|>` count) of a W × H image: (padded H / 28) · (padded W / 28)."""
    cfg = config or _RELEASED
    pw, ph = padded_size(width, height, cfg)
    m = cfg.pad_multiple
    return (pw // m) * (ph // m)


def _check_size(width, height) -> None:
    for name, v in (("width", width), ("height", height)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ImageError(f"image {name} must be a positive integer, got {v!r} (zero-size images are refused)")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ImageError(f"image is {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO}:1 is not accepted")


# ---- decoding ---------------------------------------------------------------------------------------------
def decode_data_url(url: str) -> bytes:
    """`data:image/png;base64,....` → the raw bytes."""
    m = _DATA_URL.match(url.strip())
    if not m:
        raise ImageError("image URL must be a base64 data URL like 'data:image/png;base64,...'"
                         + ("; remote URLs are not fetched" if _REMOTE.match(url) else ""))
    if m.group("mime") and not m.group("mime").startswith("image/"):
        raise ImageError(f"data URL has media type {m.group('mime')!r}; expected image/*")
    try:
        return base64.b64decode(re.sub(r"\s+", "", m.group("data")), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URL holds invalid base64: {e}") from None


def load_image(source):
    """A PIL image from bytes, a file path (str or Path), a base64 data URL or a PIL image.
    Raises ImageError for remote URLs, missing files, undecodable or zero-size data and absurd aspect ratios."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        img = source
    else:
        if isinstance(source, (bytes, bytearray, memoryview)):
            data, what = bytes(source), "image bytes"
        elif isinstance(source, str) and source.strip().startswith("data:"):
            data, what = decode_data_url(source), "data URL"
        elif isinstance(source, str) and _REMOTE.match(source):
            raise ImageError(f"remote image URLs are not fetched ({source[:60]!r}); give a file, bytes or a base64 "
                             f"data URL")
        elif isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise ImageError(f"image file not found: {path}")
            data, what = path.read_bytes(), f"image file {path}"
        else:
            raise ImageError(f"image must be bytes, a file path, a base64 data URL or a PIL image; got "
                             f"{type(source).__name__}")
        if not data:
            raise ImageError(f"{what} is empty")
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_INPUT_PIXELS:
                raise ImageError(f"{what} is {img.width}x{img.height}: more than {MAX_INPUT_PIXELS:,} pixels")
            img.load()
        except ImageError:
            raise
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise ImageError(f"{what} could not be decoded as an image: {e}") from None
    img = _upright(img)
    _check_size(img.width, img.height)
    return img


def _upright(img):
    """The image as it is meant to be seen: a camera's EXIF Orientation (a phone photo is often stored sideways)
    applied, as transformers' and diffusers' `load_image` apply it; an unreadable EXIF block is ignored."""
    from PIL import ImageOps

    try:
        if img.getexif().get(0x0112, 1) in (1, None):  # 0x0112: Orientation; 1 = as stored
            return img
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 (malformed EXIF: the pixels as stored are still an image)
        return img


# ---- pixels -------------------------------------------------------------------------------------------------
def chessboard(width: int, height: int, square: int = 8) -> np.ndarray:
    """[H, W, 3] uint8: 8-px squares, white (255) at the top-left, gray (180) alternating."""
    y, x = np.mgrid[0:height, 0:width]
    light = ((y // square) + (x // square)) % 2 == 0
    return np.repeat(np.where(light, 255, 180).astype(np.uint8)[..., None], 3, axis=2)


def _has_alpha(img) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info)


def resized_rgb(img, config: VisionConfig | None = None) -> np.ndarray:
    """The image resized by the rule (bicubic) and flattened onto the chessboard if it has alpha: [h, w, 3] u8."""
    from PIL import Image

    cfg = config or _RELEASED
    w, h = resize_size(img.width, img.height, cfg)
    alpha = _has_alpha(img)
    img = img.convert("RGBA" if alpha else "RGB")
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    if alpha:  # after the resize, as released
        board = Image.fromarray(chessboard(w, h), "RGB").convert("RGBA")
        img = Image.alpha_composite(board, img).convert("RGB")
    return np.asarray(img, dtype=np.uint8)


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """pixels: [3, H, W] with H, W multiples of patch → [(H/P)·(W/P), 3, P, P], patches row-major."""
    c, H, W = pixels.shape
    h, w = H // patch, W // patch
    return pixels.reshape(c, h, patch, w, patch).permute(1, 3, 0, 2, 4).reshape(h * w, c, patch, patch)


def preprocess_image(source, config: VisionConfig | None = None) -> ImageInput:
    """Any accepted image source (see `load_image`) → an ImageInput ready for the tower."""
    cfg = config or _RELEASED
    img = load_image(source)
    W, H = img.size
    rgb = resized_rgb(img, cfg)
    h, w = rgb.shape[:2]
    pw, ph = padded_size(W, H, cfg)
    canvas = np.zeros((ph, pw, 3), dtype=np.uint8)  # zero padding right and bottom, before normalising
    canvas[:h, :w] = rgb
    mean = torch.tensor(cfg.media_proc_cfg["image_mean"], dtype=torch.float32)[:, None, None]
    std = torch.tensor(cfg.media_proc_cfg["image_std"], dtype=torch.float32)[:, None, None]
    x = (torch.from_numpy(canvas).permute(2, 0, 1).float() / 255.0 - mean) / std
    p = cfg.patch_size
    digest = hashlib.sha256(f"{w}x{h}:".encode() + rgb.tobytes()).hexdigest()
    m = cfg.merge_kernel_size[0]
    return ImageInput(patchify(x, p), (1, ph // p, pw // p), (W, H), (w, h), (ph // p // m) * (pw // p // m), digest)


def batch_images(images: list[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack images for one tower call → (pixel_values [sum N, 3, P, P], grid_thws [n, 3] int64)."""
    if not images:
        raise ValueError("batch_images needs at least one image")
    return (torch.cat([im.pixel_values for im in images]),
            torch.tensor([im.grid_thw for im in images], dtype=torch.long))
