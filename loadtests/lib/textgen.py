"""Deterministic prompt text whose token count is known in advance.

Every "word" is three lowercase letters plus a leading space: 4 UTF-8 bytes. The simulated replicas' default
tokenizer makes one token of every 4 bytes, so `text(key, n)` is exactly `n` tokens there; with a real BPE
(MiniMax, cl100k) such common three-letter words are one token each, so counts stay close. Text depends only on
`key` (a string), so equal keys give equal text on every run and machine, and different keys share no prefix.

Also a tiny, valid PNG writer for image requests (the gateway reads image headers to estimate vision tokens).
"""

from __future__ import annotations

import base64
import hashlib
import random
import struct
import zlib
from functools import lru_cache

# Common English three-letter words (one BPE token each with a leading space in most vocabularies).
WORDS = (
    "the and for you not are but all any can her was one our out day get has him his how man new now old see two "
    "way who boy did its let put say she too use top set run own off end few far ask big air box car cat cut dog "
    "eye fun god hot job law lot map mix net oil pay red sea sit sun ten tie toy van war win yes yet age arm art "
    "bad bag bed bit bus buy cow cry cup dry ear eat egg fan fat fit fix fly fox gap gas hat hit ice key kid lab "
    "lay leg lie low mad mom mud nor odd pen pet pie pin pop pot raw row sad sky son sum tax tea tip toe try web"
).split()
assert all(len(w) == 3 for w in WORDS)
TOKEN_BYTES = 4


def _rng(key: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))


@lru_cache(maxsize=512)
def text(key: str, tokens: int) -> str:
    """`tokens` words of 4 bytes each (" xyz"), determined by `key`."""
    if tokens <= 0:
        return ""
    rnd = _rng(key)
    return "".join(" " + w for w in rnd.choices(WORDS, k=tokens))


def text_uncached(key: str, tokens: int) -> str:
    """As `text`, without keeping the result (for one-off unique segments)."""
    if tokens <= 0:
        return ""
    rnd = _rng(key)
    return "".join(" " + w for w in rnd.choices(WORDS, k=tokens))


def tokens_of(s: str) -> int:
    """Token count of a string under the 4-bytes-per-token rule (the simulator's default tokenizer)."""
    return -(-len(s.encode("utf-8")) // TOKEN_BYTES)


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A valid truecolour PNG of width×height, one flat colour chosen by `seed`."""
    r, g, b = (seed * 97) % 256, (seed * 57 + 80) % 256, (seed * 31 + 160) % 256
    row = b"\x00" + bytes((r, g, b)) * width
    raw = zlib.compress(row * height, 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


@lru_cache(maxsize=256)
def png_data_url(width: int, height: int, seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, seed)).decode()
