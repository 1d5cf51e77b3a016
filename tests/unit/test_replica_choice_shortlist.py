"""PrefixAffinity's shortlist: in a large pool only the prefix's holders, the session's replica and a few drawn
replicas are scored, so a decision costs the same whatever the pool's size; small pools are scored whole."""

from __future__ import annotations

from policies.replica_choice import ChoiceParams, PrefixAffinity
from policies.snapshot import ReplicaSnapshot, RoutingRequest
from pools.prefix_index import PrefixIndex

URLS = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(400)]


def fresh(url: str, **fields: object) -> ReplicaSnapshot:
    defaults: dict[str, object] = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.1, "metrics_age_s": 1.0}
    return ReplicaSnapshot(url=url, pool="p", **{**defaults, **fields})  # type: ignore[arg-type]


def blocks(seed: int, n: int) -> tuple[int, ...]:
    return tuple(seed * 1000 + i for i in range(n))


def test_a_pool_at_or_under_the_threshold_is_scored_whole() -> None:
    policy = PrefixAffinity(prefix_index=PrefixIndex(), params=ChoiceParams(shortlist_above=32))
    assert policy.shortlist(RoutingRequest(4096, 64, blocks(1, 8)), URLS[:32]) is None


def test_the_holder_of_the_prefix_is_shortlisted_and_chosen_in_a_large_pool() -> None:
    index = PrefixIndex()
    prompt = blocks(7, 32)
    holder = URLS[123]
    index.record(holder, prompt, now=0.0)
    policy = PrefixAffinity(prefix_index=index, params=ChoiceParams(shortlist_sample=8))
    request = RoutingRequest(4096, 64, prompt)
    short = policy.shortlist(request, URLS)
    assert short is not None and holder in short
    assert len(short) <= 1 + 8  # the holder and the draw: independent of the pool's 400 replicas
    decision = policy.choose(request, [fresh(u) for u in short], now=1.0)
    assert decision.replica == holder
    assert decision.reason == "affinity_hit"


def test_repeats_of_a_new_prefix_draw_the_same_replicas_and_meet() -> None:
    policy = PrefixAffinity(prefix_index=PrefixIndex())
    first = policy.shortlist(RoutingRequest(4096, 64, blocks(3, 8)), URLS)
    again = policy.shortlist(RoutingRequest(4096, 64, blocks(3, 8)), URLS)
    other = policy.shortlist(RoutingRequest(4096, 64, blocks(4, 8)), URLS)
    assert first is not None and first == again
    assert other is not None and set(other) != set(first)
    chosen = policy.choose(RoutingRequest(4096, 64, blocks(3, 8)), [fresh(u) for u in first], now=1.0).replica
    assert policy.choose(RoutingRequest(4096, 64, blocks(3, 8)), [fresh(u) for u in again], now=1.0).replica == chosen


def test_short_prompts_draw_afresh_and_a_session_keeps_its_replica_in_view() -> None:
    policy = PrefixAffinity(prefix_index=PrefixIndex())
    draws = [policy.shortlist(RoutingRequest(10, 16), URLS) for _ in range(20)]
    assert len({u for d in draws if d for u in d}) > 60  # the load is sampled across the pool, not one corner
    request = RoutingRequest(4096, 64, blocks(5, 8), session_key="s1")
    policy.dispatched(request, URLS[399], now=0.0)
    short = policy.shortlist(request, URLS)
    assert short is not None and URLS[399] in short
