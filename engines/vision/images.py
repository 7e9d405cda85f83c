"""Image bytes as they travel (the data's file, base64 or raw bytes, encoded PNG/JPEG/...), decoded and checked.

Images cross the bus encoded, as the data held them: a few KB to a few hundred KB each, where the processor's
pixel tensors are ten to a hundred times larger. Whoever needs pixels (the engine generating, the learner training)
decodes them here, so a truncated file or a decompression bomb fails the same way in both, with the limit named.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# Defaults of the limits a run may raise (--max-image-bytes, --max-image-pixels): a 4k photo is ~3 MB and 8.3 Mpx.
MAX_IMAGE_BYTES = 16 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096


class ImageProblem(ValueError):
    """An image that cannot be used: not an image, truncated, empty, or over a limit. The message names which."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS


DEFAULT_LIMITS = ImageLimits()


def decode_image(data: bytes, *, where: str, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image in `data` as RGB, fully read (a truncated file fails here, not later inside the processor).
    `where` names the image in the error (a dataset row and key, a request id and index)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageProblem(f"{where}: an image must be encoded bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageProblem(f"{where}: the image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageProblem(f"{where}: the image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(bytes(data)))
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageProblem(f"{where}: the image is {width}x{height} = {width * height} pixels, over the "
                                   f"limit of {limits.max_pixels}")
            image.load()
    except ImageProblem:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as error:
        raise ImageProblem(f"{where}: not a readable image ({type(error).__name__}: {error})") from None
    return image.convert("RGB")


def encode_png(image: Image.Image) -> bytes:
    """An image as PNG bytes: lossless, so what a synthetic task draws is what the model sees."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
