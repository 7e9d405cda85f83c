"""A dataset record's images (`--multimodal-keys '{"image": "images"}'`): read, checked, and tied to the prompt's
image items.

A record's image field holds one image or a list of them, each a file path (relative to the data file's folder, or
absolute), a base64 string (bare or as a `data:` URL), raw bytes (a Parquet binary column), or a Hugging Face
datasets image struct (`{"bytes": ..., "path": ...}`). The bytes are kept as the record held them (PNG, JPEG, ...):
they travel encoded (`PromptGroup.images`); each is decoded once here so a missing, truncated or oversized image
skips its record at load, named, instead of failing a rollout later. Nothing is fetched: a URL is refused.

The prompt says where the images go, as slime reads it: with image keys every prompt is chat messages (plain text
becomes one user message); in a message's text, each `<image>` mark becomes an image part, in order, and a
message whose content is already a list of parts keeps its `{"type": "image"}` parts. The parts are bare (their
bytes travel beside the prompt, not in it), and there must be exactly one per image.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.vision.images import DEFAULT_LIMITS, ImageLimits, ImageProblem, decode_image

IMAGE_MARK = "<image>"  # slime's placeholder for an image in a message's text
IMAGE_PART: dict[str, str] = {"type": "image"}
_MARK_SPLIT = re.compile(f"({re.escape(IMAGE_MARK)})")
_NETWORK = ("http://", "https://", "ftp://", "s3://", "gs://")


class PromptImageError(ValueError):
    """A prompt's images that cannot be used (missing, unreadable, too large, not one per image item, or a model
    without a vision tower): the message names the image and what is wrong. A record with one is skipped at load; a
    group with one fails its samples."""


@dataclass(frozen=True)
class ImageField:
    """Where a dataset's records hold their images and how large one may be."""

    key: str
    limits: ImageLimits = DEFAULT_LIMITS


def record_images(row: dict[str, Any], field: ImageField, folder: Path) -> list[bytes]:
    """The record's images, each checked to decode within the limits; none when the field is absent or null."""
    value = row.get(field.key)
    if value is None:
        return []
    if hasattr(value, "tolist"):  # a Parquet list column read as an array
        value = value.tolist()
    items = value if isinstance(value, list) else [value]
    images = []
    for index, item in enumerate(items):
        where = f"key {field.key!r} image {index}"
        data, source = _image_bytes(item, folder, field.limits, where)
        try:
            decode_image(data, where=f"{where} ({source})", limits=field.limits)
        except ImageProblem as error:
            raise PromptImageError(str(error)) from None
        images.append(data)
    return images


def _image_bytes(item: Any, folder: Path, limits: ImageLimits, where: str) -> tuple[bytes, str]:
    """One image's encoded bytes and what they came from (for errors)."""
    if isinstance(item, dict):  # a Hugging Face datasets Image column: {"bytes": ..., "path": ...}
        if item.get("bytes") is not None:
            item = item["bytes"]
        elif item.get("path"):
            item = item["path"]
        else:
            raise PromptImageError(f"{where}: an image object needs 'bytes' or 'path', got keys {sorted(item)}")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item), "bytes"
    if not isinstance(item, str) or not item.strip():
        raise PromptImageError(f"{where}: expected a file path, a base64 string or bytes, got "
                               f"{type(item).__name__ if not isinstance(item, str) else 'an empty string'}")
    text = item.strip()
    if text.lower().startswith(_NETWORK):
        raise PromptImageError(f"{where}: {text[:80]!r} is a URL; images are not fetched from the network (give a "
                               "file path, base64 or bytes)")
    if text.startswith("data:"):
        head, comma, payload = text.partition(",")
        if not comma or not head.endswith(";base64"):
            raise PromptImageError(f"{where}: a data: URL must be base64 ('data:image/png;base64,...'), got "
                                   f"{head[:40]!r}")
        data = _from_base64(payload, limits, where)
        if data is None:
            raise PromptImageError(f"{where}: the data: URL's payload is not base64")
        return data, "data URL"
    path = Path(text) if Path(text).is_absolute() else folder / text
    size = _file_size(path)
    if size is not None:
        if size > limits.max_bytes:
            raise PromptImageError(f"{where} (file {path}): the image is {size} bytes, over the limit of "
                                   f"{limits.max_bytes}")
        try:
            return path.read_bytes(), f"file {path}"
        except OSError as error:
            raise PromptImageError(f"{where}: cannot read {path} ({error.strerror or error})") from None
    data = _from_base64(text, limits, where)
    if data is None:
        raise PromptImageError(f"{where}: no image file {path} (and the value is not base64)")
    return data, f"read as base64: there is no file {path}"


def _file_size(path: Path) -> int | None:
    """The file's size, or None when there is no such file (or the value cannot be a path: base64 is long)."""
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:  # a name too long for the file system, and the like: not a file
        return None


def _from_base64(payload: str, limits: ImageLimits, where: str) -> bytes | None:
    """The decoded bytes, or None when `payload` is not base64; one over the byte limit is refused undecoded."""
    compact = "".join(payload.split())
    if len(compact) * 3 // 4 > limits.max_bytes + 2:
        raise PromptImageError(f"{where}: the base64 image is about {len(compact) * 3 // 4} bytes, over the limit "
                               f"of {limits.max_bytes}")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return None


def prompt_with_images(prompt: str | list[dict[str, Any]], images: int, *, input_key: str,
                       image_key: str) -> list[dict[str, Any]]:
    """The prompt as chat messages whose image parts are bare and exactly `images` in number (slime's reading:
    `<image>` marks in text, `{"type": "image"}` parts in a list of parts). A plain-text prompt is one user
    message; a message's text without a mark stays a string (a text-only template renders it as before)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    built, found = [], 0
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and IMAGE_MARK in content:
            parts = [dict(IMAGE_PART) if piece == IMAGE_MARK else {"type": "text", "text": piece}
                     for piece in _MARK_SPLIT.split(content) if piece]
        elif isinstance(content, list):
            parts = [_bare(part, input_key) for part in content]
        else:
            built.append(message)
            continue
        found += sum(1 for part in parts if part == IMAGE_PART)
        built.append({**message, "content": parts})
    if found != images:
        raise PromptImageError(f"key {input_key!r} has {found} image item(s) ('{IMAGE_MARK}' in text or "
                               f"{{'type': 'image'}} parts) for {images} image(s) in key {image_key!r}; each image "
                               "needs one, in order")
    return built


def _bare(part: Any, input_key: str) -> Any:
    """An image part without its own payload (the record's image field holds the image); other parts as they are."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image":
        return dict(IMAGE_PART)
    if kind == "image_url":
        raise PromptImageError(f"key {input_key!r}: an 'image_url' part; use {{'type': 'image'}} parts (or "
                               f"'{IMAGE_MARK}' in text) with the images in the --multimodal-keys field")
    return part
