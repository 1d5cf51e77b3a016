"""Replica choice on crafted snapshots: TTFT trade-offs, bounded load, rendezvous, sessions, filters."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest

from policies.replica_choice import (
    Candidate,
    ChoiceParams,
    LeastLoaded,
    NoReplicaAvailable,
    PrefixAffinity,
    ReplicaSnapshot,
    RoundRobin,
    RoutingRequest,
    build_policy,
    combine,
    predict_ttft,
    queue_estimate,
    rendezvous_weight,
    routable,
    saturation,
    score_balance,
    score_kv_headroom,
    score_ttft,
)
from pools.prefix_index import PrefixIndex

PARAMS = ChoiceParams()
URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def replica(url: str = URLS[0], **fields: object) -> ReplicaSnapshot:
    return ReplicaSnapshot(url=url, pool="p", **fields)  # type: ignore[arg-type]


def fresh(url: str = URLS[0], **fields: object) -> ReplicaSnapshot:
    """A replica scraped a second ago, idle unless told otherwise."""
    defaults: dict[str, object] = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.1, "metrics_age_s": 1.0}
    return replica(url, **{**defaults, **fields})


def blocks(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 1_000_000 + i for i in range(n))


def candidate(url: str, ttft: float, **fields: object) -> Candidate:
    return Candidate(url, replica(url, **fields), False, 0, 0, ttft, 0.0)


# -- filters --------------------------------------------------------------------------------------------------------


def test_unhealthy_and_draining_replicas_are_not_routable() -> None:
    assert routable(replica())
    assert not routable(replica(healthy=False))
    assert not routable(replica(draining=True))


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"metrics_age_s": 30.0}, "stale_metrics"),
        ({"metrics_age_s": 1.0, "kv_usage": 0.985}, "kv_full"),
        ({"metrics_age_s": 1.0, "waiting": 33.0}, "queue_full"),
        ({"metrics_age_s": 1.0, "kv_usage": 0.97, "waiting": 32.0}, None),
        ({}, None),  # never scraped: nothing says it is loaded
    ],
)
def test_saturation(fields: dict, why: str | None) -> None:
    assert saturation(replica(**fields), PARAMS) == why


# -- estimates ------------------------------------------------------------------------------------------------------


def test_in_flight_beyond_reported_running_counts_as_waiting() -> None:
    assert queue_estimate(fresh(in_flight=10, running=4.0, waiting=1.0), PARAMS) == (6.0, 4.0)
    assert queue_estimate(fresh(in_flight=2, running=4.0, waiting=3.0), PARAMS) == (3.0, 4.0)  # other gateways' load
    # stale or missing scrapes are not trusted: only our own in-flight requests are known, assumed running
    assert queue_estimate(replica(in_flight=5, running=1.0, waiting=9.0, metrics_age_s=60.0), PARAMS) == (0.0, 5.0)
    assert queue_estimate(replica(in_flight=5), PARAMS) == (0.0, 5.0)


def test_predicted_ttft_grows_with_uncached_tokens_queue_and_decode_load() -> None:
    r = replica(prefill_s_per_token=100e-6, tpot_s=0.03)
    idle = predict_ttft(r, 4000, waiting=0, running=0, tokens_per_waiting=0, chunk_tokens=8192)
    assert idle == pytest.approx(4000 * 100e-6)
    assert predict_ttft(r, 8000, 0, 0, 0, 8192) > idle
    assert predict_ttft(r, 4000, 2, 0, 3000, 8192) == pytest.approx(10_000 * 100e-6)
    busy = predict_ttft(r, 4000, 0, 50, 0, 8192)
    assert busy == pytest.approx(idle + 0.03)  # one engine step, which also decodes the 50 running requests
    assert predict_ttft(r, 20_000, 0, 50, 0, 8192) == pytest.approx(2.0 + 3 * 0.03)
    assert predict_ttft(r, 0, 0, 0, 0, 8192) > 0  # vLLM always computes at least the last token


# -- scorers --------------------------------------------------------------------------------------------------------


def test_ttft_scorer_gives_one_to_the_fastest_and_less_to_slower() -> None:
    scores = score_ttft([candidate("a", 0.2), candidate("b", 0.4), candidate("c", 2.0)])
    assert scores[0] == 1.0
    assert 0.45 < scores[1] < 0.55
    assert 0 < scores[2] < scores[1]


def test_kv_headroom_scorer_prefers_free_cache_and_is_neutral_when_unknown() -> None:
    scores = score_kv_headroom([candidate("a", 1, kv_usage=0.2), candidate("b", 1, kv_usage=0.9), candidate("c", 1)])
    assert scores[0] > scores[2] == 0.5 > scores[1]


def test_balance_scorer_prefers_fewer_tokens_in_flight() -> None:
    scores = score_balance([candidate("a", 1, in_flight_tokens=0), candidate("b", 1, in_flight_tokens=9_999)])
    assert scores[0] == 1.0 and scores[1] < 0.01


def test_combined_scores_follow_the_weights() -> None:
    cands = [candidate("a", 0.1, in_flight_tokens=5000), candidate("b", 0.2, in_flight_tokens=0)]
    assert combine(cands, {"ttft": 1.0})[0] > combine(cands, {"ttft": 1.0})[1]
    assert combine(cands, {"balance": 1.0})[0] < combine(cands, {"balance": 1.0})[1]
    assert combine(cands, {"ttft": 1.0, "balance": 0.0}) == combine(cands, {"ttft": 1.0})
    with pytest.raises(ValueError):
        PrefixAffinity(params=ChoiceParams(weights={"ttft": 1.0, "no_such_scorer": 1.0}))


# -- prefix affinity: the TTFT trade-off ----------------------------------------------------------------------------


NO_BOUND = {"load_epsilon": 10.0, "load_slack": 1000.0}  # the bounded-load guard out of the way
TIGHT_BOUND = {"load_epsilon": 0.25, "load_slack": 2.0}  # a bound tight enough to act on these few requests


def _affinity(index: PrefixIndex | None = None, **params: object) -> PrefixAffinity:
    return PrefixAffinity(prefix_index=index or PrefixIndex(), params=dataclasses.replace(PARAMS, **params))


def test_a_hit_on_a_lightly_loaded_replica_beats_a_miss_on_an_idle_one() -> None:
    index = PrefixIndex()
    prompt = blocks(1, 64)  # 8K tokens, all cached on A
    index.record(URLS[0], prompt, now=0.0)
    policy = _affinity(index)
    a = fresh(URLS[0], in_flight=3, in_flight_tokens=6000, running=2.0, waiting=1.0)
    b = fresh(URLS[1])
    decision = policy.choose(RoutingRequest(8192, 256, prompt), [b, a], now=1.0)
    assert decision.replica == URLS[0]
    assert decision.reason == "affinity_hit"
    assert decision.matched_blocks == 64
    assert decision.fallbacks == (URLS[1],)
    assert decision.scores[URLS[0]] > decision.scores[URLS[1]]


def test_a_miss_on_an_idle_replica_beats_a_hit_behind_a_long_queue() -> None:
    index = PrefixIndex()
    prompt = blocks(1, 64)
    index.record(URLS[0], prompt, now=0.0)
    policy = _affinity(index)
    a = fresh(URLS[0], in_flight=12, in_flight_tokens=12 * 8000, running=6.0, waiting=6.0)  # ~3 s of prefill ahead
    b = fresh(URLS[1])
    decision = policy.choose(RoutingRequest(8192, 256, prompt), [a, b], now=1.0)
    assert decision.replica == URLS[1]
    assert decision.reason == "prefix_move"
    assert decision.matched_blocks == 0
    assert decision.fallbacks == (URLS[0],)


def test_the_trade_off_turns_where_the_queue_costs_more_than_the_prefill_and_displacement() -> None:
    """Growing A's steady queue one request at a time, the choice flips once, from the cached A to the idle B, and
    only where the wait saved exceeds the prefill B adds plus move_cost_factor × that (the KV it displaces there)."""
    prompt = blocks(1, 32)  # 4K tokens cached on A; prefill added on B ≈ 4096 × 60 µs ≈ 0.25 s
    chosen, flipped_at = [], {}
    for factor in (0.0, 0.25, 1.0):
        chosen = []
        for waiting in range(0, 16):
            index = PrefixIndex()
            index.record(URLS[0], prompt, now=0.0)
            policy = _affinity(index, move_cost_factor=factor, **NO_BOUND)  # a fresh window: a queue all along
            a = fresh(URLS[0], in_flight=waiting, in_flight_tokens=waiting * 1000, running=0.0, waiting=float(waiting))
            chosen.append(policy.choose(RoutingRequest(4200, 100, prompt), [a, fresh(URLS[1])], now=1.0).replica)
        assert chosen[0] == URLS[0] and chosen[-1] == URLS[1]
        assert sum(1 for x, y in itertools.pairwise(chosen) if x != y) == 1
        flipped_at[factor] = chosen.index(URLS[1])
    assert flipped_at[0.0] < flipped_at[0.25] < flipped_at[1.0]


def test_a_burst_does_not_move_a_prefix_but_a_queue_that_persists_does() -> None:
    """The same long queue on A: seen 50 ms after a calm spell it is a burst (A keeps the request); still there two
    windows later, A is persistently overloaded and the request moves."""
    index = PrefixIndex()
    prompt = blocks(1, 32)
    index.record(URLS[0], prompt, now=0.0)
    policy = _affinity(index, **NO_BOUND)
    calm = fresh(URLS[0])
    queued = fresh(URLS[0], in_flight=12, in_flight_tokens=12 * 8000, running=0.0, waiting=12.0)
    for t in range(0, 50, 5):  # a request every 5 s
        assert policy.choose(RoutingRequest(4200, 100, prompt), [calm, fresh(URLS[1])], now=float(t)).replica == URLS[0]
    burst = policy.choose(RoutingRequest(4200, 100, prompt), [queued, fresh(URLS[1])], now=45.05)
    assert burst.replica == URLS[0] and burst.reason == "affinity_hit"
    later = policy.choose(RoutingRequest(4200, 100, prompt), [queued, fresh(URLS[1])],
                          now=45.05 + 2 * PARAMS.placement_window_s)
    assert later.replica == URLS[1] and later.reason == "prefix_move"


def test_a_hot_group_gets_a_second_home_for_a_queue_a_rare_one_keeps() -> None:
    """The same steady queue on the holder: a group that comes 4 times a second moves (its later requests share the
    move's cost), one that comes every 10 s stays."""

    def moved_after(interval: float) -> bool:
        index = PrefixIndex()
        prompt = blocks(1, 32)
        index.record(URLS[0], prompt, now=0.0)
        policy = _affinity(index)
        queued = fresh(URLS[0], in_flight=1, in_flight_tokens=3300, running=0.0, waiting=1.0)  # ~0.2 s ahead
        reasons = [policy.choose(RoutingRequest(4200, 100, prompt), [queued, fresh(URLS[1])], now=k * interval).reason
                   for k in range(20)]
        return "prefix_move" in reasons

    assert moved_after(0.25)
    assert not moved_after(10.0)


def test_never_move_keeps_every_request_on_its_prefix() -> None:
    index = PrefixIndex()
    prompt = blocks(1, 32)
    index.record(URLS[0], prompt, now=0.0)
    policy = _affinity(index, move_cost_factor=float("inf"), **NO_BOUND)
    queued = fresh(URLS[0], in_flight=12, in_flight_tokens=12 * 8000, running=0.0, waiting=12.0)
    assert policy.choose(RoutingRequest(4200, 100, prompt), [queued, fresh(URLS[1])], now=1.0).replica == URLS[0]


def test_a_prefix_held_by_several_replicas_goes_to_the_least_queued_of_them_only() -> None:
    """A replicated (hot) prefix spreads over its holders, never onto a replica that would recompute it."""
    index = PrefixIndex()
    prompt = blocks(1, 32)
    index.record(URLS[0], prompt, now=0.0)
    index.record(URLS[1], prompt, now=0.0)
    policy = _affinity(index)
    a = fresh(URLS[0], in_flight=3, in_flight_tokens=3 * 4200, running=0.0, waiting=3.0)
    b = fresh(URLS[1], in_flight=1, in_flight_tokens=4200, running=0.0, waiting=1.0)
    decision = policy.choose(RoutingRequest(4200, 100, prompt), [a, b, fresh(URLS[2]), fresh(URLS[3])], now=1.0)
    assert decision.replica == URLS[1] and decision.reason == "affinity_hit"


def test_without_an_index_prefix_affinity_still_balances() -> None:
    policy = PrefixAffinity(prefix_index=None)
    busy = fresh(URLS[0], in_flight=10, in_flight_tokens=50_000, running=2.0, waiting=8.0)
    decision = policy.choose(RoutingRequest(1000, 100, blocks(1, 7)), [busy, fresh(URLS[1])], now=0.0)
    assert decision.replica == URLS[1]


# -- bounded load under a hot prefix --------------------------------------------------------------------------------


class FakeGateway:
    """Just enough of the gateway: in-flight accounting per replica, and the choose → dispatched protocol."""

    def __init__(self, policy: PrefixAffinity, urls: list[str]):
        self.policy = policy
        self.in_flight: Counter[str] = Counter({u: 0 for u in urls})
        self.tokens: Counter[str] = Counter({u: 0 for u in urls})
        self.hits = 0

        self.prefill: Counter[str] = Counter({u: 0 for u in urls})  # uncached tokens sent, no first token yet

    def snapshots(self) -> list[ReplicaSnapshot]:
        return [replica(u, in_flight=self.in_flight[u], in_flight_tokens=self.tokens[u],
                        prefill_tokens=self.prefill[u]) for u in self.in_flight]

    def send(self, request: RoutingRequest, now: float) -> str:
        decision = self.policy.choose(request, self.snapshots(), now)
        self.policy.dispatched(request, decision.replica, now)
        self.in_flight[decision.replica] += 1
        self.tokens[decision.replica] += request.prompt_tokens + request.output_budget
        self.prefill[decision.replica] += request.prompt_tokens - decision.matched_blocks * 128
        self.hits += decision.matched_blocks > 0
        return decision.replica


def _hot_prompt_sessions(policy: PrefixAffinity) -> FakeGateway:
    gateway = FakeGateway(policy, URLS)
    system = blocks(7, 16)  # a 2K-token system prompt shared by every session
    for session in range(100):
        request = RoutingRequest(2300, 500, system + blocks(1000 + session, 2), session_key=f"s{session}")
        gateway.send(request, now=float(session))
    return gateway


def test_a_hot_system_prompt_is_replicated_over_the_replicas_its_queue_needs() -> None:
    """Sessions that never finish pile prefill onto the system prompt's holder until its queue persists; then the
    prompt gets other homes and new sessions spread over them, each finding the prompt cached."""
    gateway = _hot_prompt_sessions(_affinity())
    mean = 100 / len(URLS)
    assert max(gateway.in_flight.values()) <= 1.5 * mean
    assert min(gateway.in_flight.values()) >= 0.5 * mean
    assert gateway.hits >= 95  # after the first request, the prefix is found wherever it goes


def test_a_hot_system_prompt_spreads_by_the_load_bound_where_no_queue_is_seen() -> None:
    """With moves off, the bound on requests in flight alone spreads the sessions."""
    gateway = _hot_prompt_sessions(_affinity(move_cost_factor=float("inf"), **TIGHT_BOUND))
    assert max(gateway.in_flight.values()) <= 1.5 * 100 / len(URLS)


def test_without_moves_or_the_load_bound_the_hot_prompt_piles_onto_one_replica() -> None:
    """Control for the tests above: it is the placement rule, not luck, that spreads the sessions."""
    gateway = _hot_prompt_sessions(_affinity(move_cost_factor=float("inf"), load_epsilon=10.0, load_slack=1000.0))
    assert max(gateway.in_flight.values()) > 1.5 * 100 / len(URLS)


def test_the_bound_holds_with_scraped_load_from_other_gateways() -> None:
    """A replica busy with other gateways' requests counts as loaded even though we sent it nothing."""
    index = PrefixIndex()
    prompt = blocks(3, 16)
    index.record(URLS[0], prompt, now=0.0)
    policy = _affinity(index, **TIGHT_BOUND)
    others = [fresh(u, in_flight=2, running=2.0) for u in URLS[1:]]
    crowded = fresh(URLS[0], in_flight=0, running=12.0, waiting=0.0)  # full of someone else's work
    decision = policy.choose(RoutingRequest(2100, 100, prompt), [crowded, *others], now=1.0)
    assert decision.replica != URLS[0]
    assert decision.reason == "load_spill"


# -- cold prefixes: rendezvous --------------------------------------------------------------------------------------


def test_repeats_of_a_new_prefix_meet_on_the_same_replica_whatever_the_order() -> None:
    policy = _affinity()
    request = RoutingRequest(3000, 100, blocks(42, 20))
    first = policy.choose(request, [fresh(u) for u in URLS], now=0.0)
    assert first.reason == "cold_rendezvous"
    again = policy.choose(request, [fresh(u) for u in reversed(URLS)], now=0.0)
    elsewhere = _affinity().choose(request, [fresh(u) for u in URLS], now=0.0)  # another gateway instance
    assert first.replica == again.replica == elsewhere.replica
    assert first.replica == max(URLS, key=lambda u: rendezvous_weight(blocks(42, 20)[0], u))


def test_distinct_cold_prefixes_spread_evenly() -> None:
    policy = _affinity()
    counts = Counter(
        policy.choose(RoutingRequest(3000, 100, blocks(tag, 20)), [fresh(u) for u in URLS], now=0.0).replica
        for tag in range(400)
    )
    assert set(counts) == set(URLS)
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_new_prefixes_go_where_the_homed_ones_bring_back_the_least_traffic() -> None:
    """Groups founded one after another, each then sending as often as the others: they spread about evenly,
    where hashing their first blocks alone leaves one replica more groups than its cache holds."""
    policy = _affinity()
    groups = [blocks(100 + g, 20) for g in range(24)]
    homes: dict[int, str] = {}
    now = 0.0
    for g in range(24):
        for earlier, prompt in enumerate(groups[:g]):  # each founded group keeps sending
            decision = policy.choose(RoutingRequest(3000, 100, prompt), [fresh(u) for u in URLS], now)
            policy.dispatched(RoutingRequest(3000, 100, prompt), decision.replica, now)
            assert decision.replica == homes[earlier]
            now += 1.0 / max(g, 1)
        first = policy.choose(RoutingRequest(3000, 100, groups[g]), [fresh(u) for u in URLS], now)
        assert first.reason == "cold_rendezvous"
        policy.dispatched(RoutingRequest(3000, 100, groups[g]), first.replica, now)
        homes[g] = first.replica
    spread = Counter(homes.values())
    hashed = Counter(max(URLS, key=lambda u: rendezvous_weight(prompt[0], u)) for prompt in groups)
    assert max(spread.values()) - min(spread.values()) <= 2 < max(hashed.values()) - min(hashed.values())


def test_a_new_prefix_goes_where_the_outstanding_prefill_ends_first() -> None:
    """Every replica has one whole 7,200-token prompt outstanding, begun at different times: the analytic TTFT
    sees four equal queues, the step clocks (a calibrated pool) see which one frees first, and a new prefix, all
    of it to prefill, goes there, whatever its first block hashes to."""
    from policies.latency_model import TtftCalibrator

    begun = {URLS[0]: 0.60, URLS[1]: 0.10, URLS[2]: 0.40, URLS[3]: 0.25}  # seconds ago
    step_s = 0.87

    def busy(url: str) -> ReplicaSnapshot:
        ends_in = step_s - begun[url]
        return fresh(url, in_flight=1, in_flight_tokens=7200, prefill_tokens=7200, step_starts_in=-begun[url],
                     step_ends_in=ends_in, step_tokens=7200)

    hashed = {t: max(URLS, key=lambda u: rendezvous_weight(blocks(t, 56)[0], u)) for t in range(40)}
    for tag in (t for t in hashed if hashed[t] != URLS[0]):
        request = RoutingRequest(7200, 100, blocks(tag, 56))
        plain = _affinity().choose(request, [busy(u) for u in URLS], now=0.0)
        assert plain.replica == hashed[tag]  # equal analytic TTFTs: the hash decides
        clocked = PrefixAffinity(prefix_index=PrefixIndex(), params=PARAMS, calibrator=TtftCalibrator())
        decision = clocked.choose(request, [busy(u) for u in URLS], now=0.0)
        assert (decision.replica, decision.reason) == (URLS[0], "cold_rendezvous")


def test_a_step_past_its_planned_end_stretches_every_clock() -> None:
    """A fresh pool's learnt cost is low (0.45 s planned for a 0.87 s prefill): A's step, begun 0.6 s ago, is
    overdue and has not answered; B's, begun 0.28 s ago, still "ends" in 0.17 s by the clock. A started first, so
    it frees first: the overdue step stretches both clocks and the new prefix goes to A, not B."""
    from policies.latency_model import TtftCalibrator

    planned = TtftCalibrator().cost.seconds(7200)
    begun = {URLS[0]: 0.60, URLS[1]: 0.28}
    snapshots = [fresh(u, in_flight=1, in_flight_tokens=7200, prefill_tokens=7200, step_starts_in=-ago,
                       step_ends_in=planned - ago, step_tokens=7200) for u, ago in begun.items()]
    assert snapshots[0].step_ends_in < 0.0 < snapshots[1].step_ends_in
    for tag in range(20):
        policy = PrefixAffinity(prefix_index=PrefixIndex(), params=PARAMS, calibrator=TtftCalibrator())
        assert policy.choose(RoutingRequest(7200, 100, blocks(tag, 56)), snapshots, now=0.0).replica == URLS[0]


def test_rendezvous_moves_only_the_prefixes_of_a_removed_replica() -> None:
    policy = _affinity()
    before = {t: policy.choose(RoutingRequest(3000, 1, blocks(t, 20)), [fresh(u) for u in URLS], 0.0).replica
              for t in range(200)}  # fmt: skip
    after = {t: policy.choose(RoutingRequest(3000, 1, blocks(t, 20)), [fresh(u) for u in URLS[:3]], 0.0).replica
             for t in range(200)}  # fmt: skip
    moved = {t for t in before if before[t] != after[t]}
    assert moved == {t for t in before if before[t] == URLS[3]}


def test_a_busy_replica_is_not_the_rendezvous_target() -> None:
    request = RoutingRequest(3000, 100, blocks(5, 20))
    target = max(URLS, key=lambda u: rendezvous_weight(request.block_hashes[0], u))
    busy = fresh(target, in_flight=8, in_flight_tokens=64_000, running=2.0, waiting=6.0)
    decision = _affinity().choose(request, [busy if u == target else fresh(u) for u in URLS], now=0.0)
    assert decision.replica != target


def test_prompts_shorter_than_a_block_rotate_over_idle_replicas() -> None:
    policy = _affinity()
    chosen = {policy.choose(RoutingRequest(20, 10), [fresh(u) for u in URLS], now=0.0).replica for _ in range(8)}
    assert chosen == set(URLS)


# -- sessions -------------------------------------------------------------------------------------------------------


def test_a_session_sticks_to_its_replica_while_it_pays() -> None:
    policy = _affinity()
    request = RoutingRequest(3000, 100, blocks(9, 20), session_key="alice")
    policy.dispatched(request, URLS[2], now=0.0)  # e.g. a retry took it there
    # URLS[0] is a little less loaded, but URLS[2] is within the stickiness factor
    snaps = [fresh(URLS[0]), fresh(URLS[1], in_flight=1, running=1.0), fresh(URLS[2], in_flight=1, running=1.0)]
    decision = policy.choose(request, snaps, now=1.0)
    assert decision.replica == URLS[2] and decision.reason == "session"


def test_a_session_leaves_its_replica_when_overloaded_and_follows_the_move() -> None:
    policy = _affinity()
    request = RoutingRequest(3000, 100, blocks(9, 20), session_key="bob")
    policy.dispatched(request, URLS[0], now=0.0)
    overloaded = fresh(URLS[0], in_flight=20, in_flight_tokens=160_000, running=4.0, waiting=16.0)
    decision = policy.choose(request, [overloaded, fresh(URLS[1])], now=1.0)
    assert decision.replica == URLS[1] and decision.reason != "session"
    policy.dispatched(request, decision.replica, now=1.0)
    assert policy.session_replica("bob") == URLS[1]
    assert policy.choose(request, [fresh(URLS[0]), fresh(URLS[1])], now=2.0).replica == URLS[1]


def test_a_session_leaves_a_replica_over_the_load_bound_even_without_metrics() -> None:
    """With no scrape, TTFT barely sees decode load; the bound on requests in flight still moves the session."""
    policy = _affinity(**TIGHT_BOUND)
    request = RoutingRequest(3000, 100, blocks(9, 20), session_key="dave")
    policy.dispatched(request, URLS[0], now=0.0)
    within = [replica(URLS[0], in_flight=6), *(replica(u, in_flight=4) for u in URLS[1:])]
    assert policy.choose(request, within, now=1.0).reason == "session"
    over = [replica(URLS[0], in_flight=12), *(replica(u, in_flight=4) for u in URLS[1:])]
    decision = policy.choose(request, over, now=1.0)
    assert decision.replica != URLS[0] and decision.reason == "load_spill"


def test_a_session_leaves_an_unhealthy_or_saturated_replica() -> None:
    policy = _affinity()
    request = RoutingRequest(3000, 100, blocks(9, 20), session_key="carol")
    policy.dispatched(request, URLS[0], now=0.0)
    assert policy.choose(request, [fresh(URLS[0], healthy=False), fresh(URLS[1])], now=1.0).replica == URLS[1]
    full_queue = fresh(URLS[0], kv_usage=0.99, waiting=40.0)
    assert policy.choose(request, [full_queue, fresh(URLS[1])], now=1.0).replica == URLS[1]


def test_a_full_kv_keeps_the_requests_whose_prefix_it_holds() -> None:
    """KV usage at the limit marks a replica saturated for new work, but a request whose prefix it holds writes
    only its uncached part there (a miss elsewhere writes all of it): it stays, while a prompt the replica does not
    hold, and a replica with a full queue, are still kept out."""
    policy = _affinity()
    request = RoutingRequest(3000, 100, blocks(9, 20), session_key="carol")
    policy.dispatched(request, URLS[0], now=0.0)
    full = fresh(URLS[0], kv_usage=0.99)
    decision = policy.choose(request, [full, fresh(URLS[1])], now=1.0)
    assert (decision.replica, decision.reason) == (URLS[0], "session")
    unseen = RoutingRequest(3000, 100, blocks(10, 20))
    assert policy.choose(unseen, [full, fresh(URLS[1])], now=1.0).replica == URLS[1]
    stale = fresh(URLS[0], kv_usage=0.99, metrics_age_s=30.0)
    assert policy.choose(request, [stale, fresh(URLS[1])], now=1.0).replica == URLS[1]


def test_sessions_are_a_bounded_lru_and_expire() -> None:
    policy = _affinity(max_sessions=10, session_ttl_s=100.0)
    for i in range(20):
        policy.dispatched(RoutingRequest(10, 10, session_key=f"s{i}"), URLS[i % 4], now=float(i))
    assert policy.session_replica("s0") is None
    assert policy.session_replica("s19") == URLS[3]
    request = RoutingRequest(3000, 100, blocks(77, 20), session_key="s19")
    assert policy.choose(request, [fresh(u) for u in URLS], now=50.0).reason == "session"
    assert policy.choose(request, [fresh(u) for u in URLS], now=500.0).reason != "session"


# -- saturation and failure -----------------------------------------------------------------------------------------


def test_stale_metrics_keep_a_replica_out_even_with_the_best_cache() -> None:
    index = PrefixIndex()
    prompt = blocks(1, 64)
    index.record(URLS[0], prompt, now=0.0)
    decision = _affinity(index).choose(
        RoutingRequest(8192, 100, prompt), [fresh(URLS[0], metrics_age_s=45.0), fresh(URLS[1])], now=50.0
    )
    assert decision.replica == URLS[1]
    assert decision.fallbacks == (URLS[0],)  # still a last resort for a retry


def test_when_every_replica_is_saturated_the_least_bad_is_still_chosen() -> None:
    full = [
        fresh(URLS[0], kv_usage=0.99, waiting=40.0, running=30.0, in_flight=70, in_flight_tokens=500_000),
        fresh(URLS[1], kv_usage=0.99, waiting=35.0, running=30.0, in_flight=65, in_flight_tokens=300_000),
        fresh(URLS[2], metrics_age_s=120.0),
    ]
    for policy in (_affinity(), LeastLoaded()):
        decision = policy.choose(RoutingRequest(3000, 100, blocks(3, 20)), full, now=0.0)
        assert decision.replica in URLS[:3]
        assert set(decision.fallbacks) | {decision.replica} == set(URLS[:3])
    assert _affinity().choose(RoutingRequest(3000, 100, blocks(3, 20)), full, 0.0).reason == "all_saturated"


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_affinity"])
def test_no_replica_available_when_all_are_unhealthy_or_draining(name: str) -> None:
    policy = build_policy(name)
    with pytest.raises(NoReplicaAvailable) as caught:
        policy.choose(RoutingRequest(10, 10), [replica(URLS[0], healthy=False), replica(URLS[1], draining=True)], 0.0)
    assert caught.value.pool == "p" and caught.value.considered == 2
    with pytest.raises(NoReplicaAvailable):
        policy.choose(RoutingRequest(10, 10), [], 0.0)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_affinity"])
def test_fallbacks_rank_every_other_routable_replica_once(name: str) -> None:
    snaps = [fresh(u, in_flight=i, in_flight_tokens=1000 * i) for i, u in enumerate(URLS)]
    snaps.append(fresh("http://10.0.0.9:8000", healthy=False))
    decision = build_policy(name).choose(RoutingRequest(3000, 100, blocks(4, 20)), snaps, now=0.0)
    assert sorted((decision.replica, *decision.fallbacks)) == sorted(URLS)


# -- the simpler policies -------------------------------------------------------------------------------------------


def test_round_robin_cycles_over_healthy_replicas() -> None:
    policy = RoundRobin()
    snaps = [replica(URLS[0]), replica(URLS[1], healthy=False), replica(URLS[2])]
    chosen = [policy.choose(RoutingRequest(10, 10), snaps, 0.0).replica for _ in range(4)]
    assert chosen == [URLS[0], URLS[2], URLS[0], URLS[2]]


def test_least_loaded_counts_tokens_in_flight_and_waiting_and_rotates_ties() -> None:
    policy = LeastLoaded()
    snaps = [
        fresh(URLS[0], in_flight=1, in_flight_tokens=1000, running=1.0),
        fresh(URLS[1], in_flight=1, in_flight_tokens=1000, running=1.0, waiting=3.0),
        fresh(URLS[2], in_flight=1, in_flight_tokens=1000, running=1.0),
        fresh(URLS[3], in_flight=1, in_flight_tokens=90_000, running=1.0),
    ]
    chosen = [policy.choose(RoutingRequest(1000, 10), snaps, 0.0) for _ in range(4)]
    assert {d.replica for d in chosen} == {URLS[0], URLS[2]}
    assert all(d.fallbacks[-2:] in ((URLS[1], URLS[3]), (URLS[3], URLS[1])) for d in chosen)
    assert all(d.fallbacks[-1] == URLS[3] for d in chosen)


def test_build_policy_passes_parameters_and_rejects_unknown_names() -> None:
    index = PrefixIndex()
    policy = build_policy("prefix_affinity", prefix_index=index, load_epsilon=0.5)
    assert isinstance(policy, PrefixAffinity)
    assert policy.prefix_index is index and policy.params.load_epsilon == 0.5
    assert isinstance(build_policy("least_loaded", params=ChoiceParams(max_waiting=3)), LeastLoaded)
    with pytest.raises(ValueError):
        build_policy("random")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        build_policy("least_loaded", no_such_param=1)


def test_dispatched_records_the_prefix_where_the_request_went() -> None:
    index = PrefixIndex()
    policy = build_policy("prefix_affinity", prefix_index=index)
    request = RoutingRequest(3000, 100, blocks(8, 20))
    policy.dispatched(request, URLS[1], now=0.0)  # e.g. a retry on the first fallback
    assert index.match_all(request.block_hashes) == {URLS[1]: 20}
    decision = policy.choose(request, [fresh(u) for u in URLS], now=1.0)
    assert decision.replica == URLS[1] and decision.reason == "affinity_hit"


class _DeepMatcher:
    """A matcher whose match runs deeper than the request's approximate hashes (precise pools match exact ones)."""

    def match_all(self, hashes: object) -> dict[str, int]:
        return {URLS[0]: 70}

    def record(self, replica: str, hashes: object, now: float) -> None:
        return None


def test_a_match_deeper_than_the_requests_hashes_still_names_its_group() -> None:
    policy = PrefixAffinity(prefix_index=_DeepMatcher())
    request = RoutingRequest(9000, 100, blocks(1, 3))
    for t in range(3):
        decision = policy.choose(request, [fresh(URLS[0]), fresh(URLS[1])], now=float(t))
        assert decision.replica == URLS[0] and decision.reason == "affinity_hit"
