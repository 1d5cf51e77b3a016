"""The hot path builds a few dataclasses by position (cheaper than keywords): each field must still land where its
name says, and the lock-free short-piece token cache must count exactly what tiktoken counts."""

from __future__ import annotations

import dataclasses

from policies.classify import RequestProfile, classify
from policies.snapshot import ReplicaSnapshot
from policies.tokens import SHORT_CACHE_ENTRIES, TokenCounter
from policies.config import ClassificationConfig
from pools.replicas import Replica, ScrapedLoad


def test_replica_snapshot_fields_land_by_name() -> None:
    replica = Replica(url="http://10.0.0.1:8000", pool="p", block_size=64, kv_blocks=777, healthy=True,
                      draining=True, ejected_until=5.0, in_flight=3, in_flight_tokens=4000,
                      scraped=ScrapedLoad(waiting=2.0, running=6.0, kv_usage=0.5), scraped_at=90.0,
                      prefill_s_per_token=1e-5, tpot_s=0.03, prefill_tokens=1234, step_start=100.5, step_end=101.25,
                      step_tokens=700)
    snap = replica.snapshot(100.0, remote_in_flight=2)
    assert snap == ReplicaSnapshot(url="http://10.0.0.1:8000", pool="p", healthy=True, draining=True, in_flight=5,
                                   in_flight_tokens=4000, waiting=2.0, running=6.0, kv_usage=0.5, metrics_age_s=10.0,
                                   prefill_s_per_token=1e-5, tpot_s=0.03, kv_blocks=777, block_size=64,
                                   prefill_tokens=1234, step_starts_in=0.5, step_ends_in=1.25, step_tokens=700)
    assert replica.snapshot(4.0).healthy is False  # still ejected
    never = Replica(url="u", pool="p").snapshot(1.0)
    assert (never.waiting, never.running, never.kv_usage, never.metrics_age_s) == (None, None, None, None)


def test_request_profile_fields_land_by_name() -> None:
    cfg = ClassificationConfig()
    body = {"model": "m", "stream": True, "max_completion_tokens": 77,
            "chat_template_kwargs": {"thinking_mode": "disabled"},
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}]}]}
    profile = classify(body, "chat", cfg, TokenCounter(cfg))
    assert {f.name for f in dataclasses.fields(RequestProfile)} == {
        "api", "model", "prompt_tokens", "output_budget", "budget_explicit", "modalities", "thinking_mode", "stream",
        "n_images", "n_videos", "estimate_exact", "budget_field", "model_counted", "estimate_error",
        "estimate_refinable"}
    assert profile.api == "chat" and profile.model == "m" and profile.stream is True
    assert profile.output_budget == 77 and profile.budget_explicit is True
    assert profile.budget_field == "max_completion_tokens" and profile.thinking_mode == "disabled"
    assert profile.modalities == frozenset({"text", "image", "video"})
    assert (profile.n_images, profile.n_videos, profile.estimate_exact, profile.model_counted) == (1, 1, True, False)
    assert profile.estimate_error == 0.0 and profile.estimate_refinable is False
    assert profile.prompt_tokens > cfg.image_tokens_default + cfg.video_tokens_default
    sampled = classify({"messages": [{"role": "user", "content": "word and number 12 " * 2000}]}, "chat", cfg,
                       TokenCounter(cfg))
    assert sampled.estimate_exact is False and 0 < sampled.estimate_error < 0.1 and sampled.model_counted is False
    assert sampled.estimate_refinable is True
    precise = classify({"messages": [{"role": "user", "content": "word and number 12 " * 2000}]}, "chat", cfg,
                       TokenCounter(cfg), precise=True)
    assert precise.estimate_refinable is False and 0 < precise.estimate_error <= sampled.estimate_error
    plain = classify({"messages": [{"role": "user", "content": "hi"}]}, "chat", cfg, TokenCounter(cfg))
    assert plain.modalities == frozenset({"text"}) and plain.model is None and plain.stream is False
    assert plain.budget_explicit is False and plain.budget_field is None


def test_short_piece_cache_counts_exactly_and_stays_bounded() -> None:
    counter = TokenCounter()
    texts = [f"hello world number {i} " * (1 + i % 20) for i in range(SHORT_CACHE_ENTRIES + 50)]
    for _ in range(2):  # second pass: partly from the cache, partly evicted and counted again
        for text in texts[:200] + texts[-200:]:
            assert counter.count(text) == counter.count_exact(text)
    for text in texts:
        counter.count(text)
    assert len(counter._short) == SHORT_CACHE_ENTRIES
    pieces = ["system prompt", "a user turn", "an answer", "x" * 600]
    assert counter.measure_pieces(pieces).tokens == sum(counter.count_exact(p) for p in pieces)


def test_a_short_text_over_a_small_full_count_threshold_is_still_estimated() -> None:
    counter = TokenCounter(ClassificationConfig(full_count_below_chars=100), sample_windows=4, window_chars=16)
    measured = counter.measure("word " * 60)  # 300 characters: above the threshold, below the short-cache bound
    assert measured.exact is False
