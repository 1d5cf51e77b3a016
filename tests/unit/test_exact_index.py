"""The exact per-replica block index fed by KV events, and the hybrid matcher PrefixAffinity reads."""

from __future__ import annotations

from policies.replica_choice import PrefixAffinity, ReplicaSnapshot, RoutingRequest
from pools.exact_index import ExactIndex, HybridMatcher
from pools.prefix_index import PrefixIndex

A, B = "http://a:8000", "http://b:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def live_index(clock: Clock, *replicas: str, **kw: float) -> ExactIndex:
    index = ExactIndex(clock, **kw)
    for r in replicas:
        index.add_source(r, r, kv_blocks=100)
        index.set_live(r, True)
    return index


def test_stored_removed_cleared_and_leading_matches() -> None:
    clock = Clock()
    index = live_index(clock, A, B, pending_ttl_s=0)
    index.stored(A, [1, 2, 3, 4])
    index.stored(B, [1, 2])
    assert index.match_all([1, 2, 3, 4, 5]) == {A: 4, B: 2}
    index.removed(A, [2])  # a hole: only the leading run counts, as for vLLM's prefix hit
    assert index.match_all([1, 2, 3]) == {A: 1, B: 2}
    index.cleared(B)
    assert index.match_all([1, 2, 3]) == {A: 1}
    assert index.size(B) == 0 and index.distinct_blocks() == 3


def test_each_source_is_bounded_by_its_kv_blocks_and_removal_frees_everything() -> None:
    clock = Clock()
    index = ExactIndex(clock)
    index.add_source(A, A, kv_blocks=3)
    index.set_live(A, True)
    index.stored(A, [1, 2, 3, 4, 5])  # more than the replica can hold: removals were lost, the oldest go
    assert index.size(A) == 3 and index.overflow_evictions() == 2
    assert index.match_all([3, 4, 5]) == {A: 3}
    index.sync({})  # the replica left the pool (reload, discovery)
    assert len(index) == 0 and index.distinct_blocks() == 0 and index.replicas() == []


def test_data_parallel_ranks_are_separate_sources_and_the_best_rank_counts() -> None:
    clock = Clock()
    index = ExactIndex(clock, pending_ttl_s=0)
    index.sync({A: (A, 10), A + "#dp1": (A, 10)})
    index.set_live(A, True)
    index.set_live(A + "#dp1", True)
    index.stored(A, [1])
    index.stored(A + "#dp1", [1, 2, 3])
    index.removed(A, [1])  # rank 0 dropped it; rank 1 still holds it
    assert index.match_all([1, 2, 3]) == {A: 3}
    assert index.fresh(A, clock())


def test_freshness_not_synced_marked_stale_and_silent() -> None:
    clock = Clock()
    index = ExactIndex(clock, silent_after_s=5.0)
    index.add_source(A, A, 10)
    assert index.stale_reason(A, clock()) == "not_synced"
    assert index.stale_reason(B, clock()) == "no_events"
    index.set_live(A, True)
    assert index.fresh(A, clock())
    index.mark_stale(A, "partial_history", until=clock() + 30)
    assert index.stale_reason(A, clock()) == "partial_history"
    clock.now += 31
    assert index.fresh(A, clock())
    # a request with blocks the replica does not hold was sent: events are due
    index.sent(A, [7, 8], clock())
    clock.now += 4
    assert index.fresh(A, clock())
    clock.now += 2
    assert index.stale_reason(A, clock()) == "silent"
    index.heard(A, clock())  # any batch: the publisher is alive
    assert index.fresh(A, clock())
    # a request fully held produces no BlockStored: sending it must not make the replica look silent
    index.stored(A, [7, 8])
    index.sent(A, [7, 8], clock())
    clock.now += 60
    assert index.fresh(A, clock())


def test_pending_blocks_count_until_confirmed_removed_or_expired() -> None:
    clock = Clock()
    index = live_index(clock, A, pending_ttl_s=10.0)
    index.sent(A, [1, 2, 3], clock())
    assert index.match_all([1, 2, 3, 4]) == {A: 3}  # a burst sharing a new prefix meets on A
    index.stored(A, [1, 2])  # confirmed: no longer pending, still held
    assert index.pending_size(A) == 1 and index.match_all([1, 2, 3]) == {A: 3}
    index.removed(A, [3])  # evicted before the events caught up: never counted again
    assert index.match_all([1, 2, 3]) == {A: 2}
    index.sent(A, [9], clock())
    clock.now += 11
    assert index.match_all([9]) == {}


def snap(url: str, **kw: object) -> ReplicaSnapshot:
    return ReplicaSnapshot(url=url, pool="p", **kw)  # type: ignore[arg-type]


def test_policy_reason_says_exact_or_approx_and_stale_replicas_fall_back() -> None:
    clock = Clock()
    approx = PrefixIndex()
    exact = live_index(clock, A, B, pending_ttl_s=0)
    matcher = HybridMatcher(approx, exact, clock)
    policy = PrefixAffinity(matcher)
    replicas = [snap(A), snap(B)]

    exact.stored(B, [11, 12, 13])
    approx.record(A, (1, 2, 3), 0.0)  # the estimate believes A holds it; B's own events say B does
    request = RoutingRequest(3 * 128, 16, block_hashes=(1, 2, 3), exact_block_hashes=(11, 12, 13))
    decision = policy.choose(request, replicas, clock())
    assert (decision.replica, decision.reason, decision.matched_blocks) == (B, "affinity_hit:exact", 3)

    exact.set_live(B, False, "disconnected")  # B's stream broke: both are judged by the estimate
    exact.set_live(A, False, "disconnected")
    decision = policy.choose(request, replicas, clock())
    assert (decision.replica, decision.reason) == (A, "affinity_hit:approx")
    assert matcher.counters.stale_fallbacks == {"disconnected": 2}
    assert matcher.counters.replicas_exact == 2 and matcher.counters.replicas_approx == 2

    no_exact = RoutingRequest(3 * 128, 16, block_hashes=(1, 2, 3))  # e.g. an image request: estimate only
    exact.set_live(A, True)
    exact.set_live(B, True)
    assert policy.choose(no_exact, replicas, clock()).reason == "affinity_hit:approx"
    assert matcher.counters.requests_approx_only == 1


def test_dispatch_records_both_views() -> None:
    clock = Clock()
    approx = PrefixIndex()
    exact = live_index(clock, A, pending_ttl_s=10.0)
    policy = PrefixAffinity(HybridMatcher(approx, exact, clock))
    request = RoutingRequest(2 * 128, 16, block_hashes=(1, 2), exact_block_hashes=(11, 12))
    policy.dispatched(request, A, clock())
    assert approx.match(A, (1, 2)) == 2 and exact.match(A, (11, 12), clock()) == 2
    assert exact.match(A, (11, 12), clock(), pending=False) == 0


def test_plain_prefix_index_keeps_the_unsuffixed_reason() -> None:
    approx = PrefixIndex()
    approx.record(A, (1, 2), 0.0)
    decision = PrefixAffinity(approx).choose(RoutingRequest(256, 16, block_hashes=(1, 2)), [snap(A), snap(B)], 1.0)
    assert decision.reason == "affinity_hit"
