"""Image sizes from the first bytes of inline (base64) images, to estimate their vision tokens without decoding them.

An inline image can be megabytes of base64, and the gateway only needs its width and height. Base64 maps every 4
characters to 3 bytes, so any byte range can be decoded on its own: this module reads the few header bytes of
PNG, GIF, WebP and JPEG (whose size marker may sit behind skippable segments) and never decodes the pixels.
Remote image URLs are never fetched: their size is unknown and the caller falls back to a default.
"""

from __future__ import annotations

import binascii
import math

_DATA_URL_HEADER_MAX = 256  # "data:<mime>[;params];base64," is short; look no further for the comma
_JPEG_MAX_SEGMENTS = 64  # APPn segments (EXIF, ICC) before the frame header; give up after this many


def image_tokens(width: int, height: int, patch_pixels: int, tokens_max: int) -> int:
    """Vision tokens of a width×height image: one per patch, at least 1, at most `tokens_max`."""
    return max(1, min(tokens_max, math.ceil(width * height / patch_pixels)))


def base64_payload_start(data_url: str) -> int | None:
    """Index where the base64 payload of a `data:...;base64,` URL starts, or None if it is not one."""
    if not data_url.startswith("data:"):
        return None
    comma = data_url.find(",", 5, _DATA_URL_HEADER_MAX)
    if comma < 0 or not data_url[5:comma].endswith(";base64"):
        return None
    return comma + 1


def image_size_from_data_url(data_url: str) -> tuple[int, int] | None:
    """(width, height) of a base64 `data:` URL image, or None if unknown (not base64, not a known format)."""
    start = base64_payload_start(data_url)
    return None if start is None else image_size_from_base64(data_url, start)


def image_size_from_base64(text: str, start: int = 0) -> tuple[int, int] | None:
    """(width, height) of the base64 image that begins at `text[start]`, reading only its header bytes."""
    reader = _Base64Reader(text, start)
    head = reader.read(0, 12)  # enough to tell the format; each format then reads only what it needs
    if head is None or len(head) < 12:
        return None
    size: tuple[int, int] | None = None
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        ihdr = reader.read(12, 12)
        if ihdr is not None and len(ihdr) == 12 and ihdr[:4] == b"IHDR":
            size = int.from_bytes(ihdr[4:8], "big"), int.from_bytes(ihdr[8:12], "big")
    elif head[:6] in (b"GIF87a", b"GIF89a"):
        size = int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little")
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        chunk = reader.read(0, 30)
        size = _webp_size(chunk) if chunk is not None and len(chunk) == 30 else None
    elif head[:3] == b"\xff\xd8\xff":
        size = _jpeg_size(reader)
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return size


class _Base64Reader:
    """Random access to the bytes of a base64 string without decoding all of it."""

    __slots__ = ("_text", "_start")

    def __init__(self, text: str, start: int) -> None:
        self._text = text
        self._start = start

    def read(self, offset: int, length: int) -> bytes | None:
        """Bytes [offset, offset+length) (fewer at the end), or None where the text is not plain base64."""
        group = offset // 3
        first_char = self._start + group * 4
        n_chars = -(-(offset + length - group * 3) // 3) * 4
        chunk = self._text[first_char:first_char + n_chars]
        if len(chunk) % 4:  # the text ends mid-group: drop the incomplete group
            chunk = chunk[: len(chunk) - len(chunk) % 4]
        try:
            raw = binascii.a2b_base64(chunk, strict_mode=True)
        except (binascii.Error, ValueError):
            return None
        skip = offset - group * 3
        return raw[skip:skip + length]


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


# Start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xDA)) | {0x01}


def _jpeg_size(reader: _Base64Reader) -> tuple[int, int] | None:
    offset = 2
    for _ in range(_JPEG_MAX_SEGMENTS):
        marker = reader.read(offset, 4)  # FF, kind, and the segment length: never more of a segment than that
        if marker is None or len(marker) < 4 or marker[0] != 0xFF:
            return None
        kind = marker[1]
        if kind == 0xFF:  # fill byte before a marker
            offset += 1
            continue
        if kind in _JPEG_STANDALONE:
            offset += 2
            continue
        if kind in _JPEG_SOF:  # FF Cn, length, precision, height, width
            frame = reader.read(offset + 5, 4)
            if frame is None or len(frame) < 4:
                return None
            return int.from_bytes(frame[2:4], "big"), int.from_bytes(frame[0:2], "big")
        offset += 2 + int.from_bytes(marker[2:4], "big")
    return None
