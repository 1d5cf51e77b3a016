"""prefix_affinity's TTFT model under queueing: the pool's prefill rate, and queues made of cache hits."""

from __future__ import annotations

import pytest

from policies.replica_choice import (
    ChoiceParams,
    PrefixAffinity,
    ReplicaSnapshot,
    RoutingRequest,
    predict_ttft,
    prefill_rate,
)
from pools.prefix_index import PrefixIndex

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 4)]


def fresh(url: str, **fields: object) -> ReplicaSnapshot:
    defaults: dict[str, object] = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.5, "metrics_age_s": 1.0}
    return ReplicaSnapshot(url=url, pool="p", **{**defaults, **fields})  # type: ignore[arg-type]


def blocks(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 1_000_000 + i for i in range(n))


def test_prefill_rate_is_the_pools_least_inflated_estimate() -> None:
    replicas = [fresh(URLS[0], prefill_s_per_token=3e-3), fresh(URLS[1], prefill_s_per_token=70e-6)]
    assert prefill_rate(replicas) == 70e-6
    assert prefill_rate([]) == 60e-6


def test_predict_ttft_takes_an_explicit_rate() -> None:
    r = fresh(URLS[0], prefill_s_per_token=1e-3)
    assert predict_ttft(r, 1000, 0, 0, 0, 8192, s_per_token=50e-6) == pytest.approx(1000 * 50e-6)
    assert predict_ttft(r, 1000, 0, 0, 0, 8192) == pytest.approx(1.0)


def test_a_replica_that_served_hits_is_not_shunned_for_its_inflated_ttft_per_token() -> None:
    """TTFT / uncached tokens after hits (100 uncached tokens, 0.3 s queued) reads as 3 ms/token: judged at its own
    estimate, the queue of one request on the replica holding the whole prefix looks like 13 s and the request moves
    to an idle one; at the pool's rate the queue is what it is and the request stays."""
    index = PrefixIndex()
    prompt = blocks(1, 32)
    index.record(URLS[0], prompt, now=0.0)
    holder = fresh(URLS[0], prefill_s_per_token=3e-3, in_flight=1, in_flight_tokens=4300, running=0.0, waiting=1.0)
    idle = fresh(URLS[1], prefill_s_per_token=60e-6)
    request = RoutingRequest(4200, 100, prompt)
    own_rate = PrefixAffinity(index, ChoiceParams(pool_prefill_rate=False))
    assert own_rate.choose(request, [holder, idle], now=1.0).replica == URLS[1]
    decision = PrefixAffinity(index).choose(request, [holder, idle], now=1.0)
    assert decision.replica == URLS[0] and decision.reason == "affinity_hit"


def _queue_of_hits(params: ChoiceParams) -> str:
    """Twelve requests of a shared 4K prefix go to A (all hits), then a cold request compares A's queue of five of
    them with B's queue of two full prompts."""
    index = PrefixIndex()
    shared = blocks(1, 32)
    index.record(URLS[0], shared, now=0.0)
    policy = PrefixAffinity(index, params)
    a, b = fresh(URLS[0]), fresh(URLS[1])
    for n in range(12):
        request = RoutingRequest(4200, 64, (*shared, 10_000 + n))
        decision = policy.choose(request, [a, b], now=1.0)
        assert decision.replica == URLS[0]
        policy.dispatched(request, decision.replica, now=1.0)
    a = fresh(URLS[0], in_flight=5, in_flight_tokens=5 * 4264, running=0.0, waiting=5.0)
    b = fresh(URLS[1], in_flight=2, in_flight_tokens=2 * 4264, running=0.0, waiting=2.0)
    return policy.choose(RoutingRequest(4200, 64, blocks(2, 32)), [a, b], now=2.0).replica


def test_a_queue_of_cache_hits_counts_for_what_it_will_prefill() -> None:
    assert _queue_of_hits(ChoiceParams()) == URLS[0]  # 5 × ~130 uncached tokens ahead, not 5 × 4264
    assert _queue_of_hits(ChoiceParams(queue_uncached_alpha=None)) == URLS[1]  # whole prompts: A looks busier


def test_the_uncached_share_follows_dispatches_only_of_the_chosen_request() -> None:
    index = PrefixIndex()
    policy = PrefixAffinity(index)
    a, b = fresh(URLS[0]), fresh(URLS[1])
    first = RoutingRequest(4096, 64, blocks(1, 32))
    decision = policy.choose(first, [a, b], now=0.0)
    policy.dispatched(RoutingRequest(4096, 64, blocks(9, 32)), decision.replica, now=0.0)  # not the one chosen
    assert policy._uncached_share == {}
    policy.dispatched(first, decision.replica, now=0.0)  # a miss: its share is 1
    assert policy._uncached_share == {decision.replica: 1.0}
    index.record(URLS[0], blocks(3, 32), now=0.0)
    hit = RoutingRequest(4096, 64, blocks(3, 32))
    assert policy.choose(hit, [a, b], now=0.0).replica == URLS[0]
    policy.dispatched(hit, URLS[0], now=0.0)  # a full hit: share 0, weighed in at alpha = 0.2 from 1
    assert policy._uncached_share[URLS[0]] == pytest.approx(0.8)
