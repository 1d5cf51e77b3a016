"""Replica choice inside one pool: filters → scorers (each 0..1, weighted) → picker, over a snapshot.

Pure: no I/O, no clock reads (a monotonic `now` is passed in), no globals. The gateway owns one policy object per
pool (`build_policy`) and, per request:

1. builds a `RoutingRequest` (prompt tokens, output budget, `policies.prefix.prefix_blocks(...)`, session key) and a
   list of `ReplicaSnapshot`s of the pool's replicas — with its own in-flight counts already including every request
   dispatched so far, since bounded load and queue estimates depend on them;
2. calls `choose(request, snapshots, now)`; on `NoReplicaAvailable` it spills to another pool or answers 503;
3. calls `dispatched(request, url, now)` each time it really sends the request to a replica (the chosen one, and a
   fallback on a retry before the first byte). That is when the prefix index learns that the replica now holds the
   request's blocks (so the next request with the same prefix finds it even while this one is still prefilling) and
   when the session remembers its replica. Nothing else writes to the index from this module;
4. keeps the index's replicas in step with the pools: `prefix_index.sync({url: kv_blocks or None, ...})` after
   discovery, a config reload or a scrape that learnt num_gpu_blocks (or remove_replica / resize one by one), and
   `prefix_index.clear_replica(url)` when a replica restarts (its cache is empty).

Build it as `build_policy("prefix_affinity", prefix_index=PrefixIndex())` (pools.prefix_index), one index per pool
or one shared by all pools (URLs are distinct); without an index the policy still balances on predicted TTFT but
never sees a cache hit.

The prefix_affinity policy predicts each replica's time to first token (queue ahead + prefill of the part of the
prompt it has not cached) and places prefixes over time (policies/placement.py): a request follows its prefix's
replicas and leaves them only when a queue that persists there outweighs the move's recompute and the KV it
displaces, so a burst never scatters a group while a genuinely hot prefix gets as many homes as its queue needs;
cold prefixes meet again through rendezvous hashing among the replicas with room for them, a bounded-load guard
holds where no queue is seen, and saturated or stale replicas are avoided but still used when nothing else is left.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import xxhash

from policies.latency_model import TtftCalibrator, prefill_plan, ttft_features
from policies.placement import DispatchRate, QueueWindow, move_cost_s, should_move
from policies.snapshot import NoReplicaAvailable, ReplicaSnapshot, RoutingDecision, RoutingRequest

__all__ = [
    "NoReplicaAvailable",
    "ReplicaPolicy",
    "ReplicaSnapshot",
    "RoutingDecision",
    "RoutingRequest",
    "PolicyName",
    "PrefixMatcher",
    "PrefixMatch",
    "RequestMatcher",
    "ChoiceParams",
    "Candidate",
    "RoundRobin",
    "LeastLoaded",
    "PrefixAffinity",
    "SCORERS",
    "build_policy",
    "routable",
    "saturation",
    "queue_estimate",
    "predict_ttft",
    "prefill_rate",
    "rendezvous_weight",
    "score_ttft",
    "score_kv_headroom",
    "score_balance",
]

PolicyName = Literal["round_robin", "least_loaded", "prefix_affinity"]


class ReplicaPolicy(Protocol):
    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot], now: float) -> RoutingDecision:
        """Pick a replica; raise NoReplicaAvailable when every replica is filtered out."""
        ...

    def dispatched(self, request: RoutingRequest, replica: str, now: float) -> None:
        """Called by the gateway when the request is really sent to `replica` (after choose, and on each retry)."""
        ...


class PrefixMatcher(Protocol):
    """What prefix_affinity needs from pools.prefix_index.PrefixIndex (in-memory reads and writes, no I/O)."""

    def match_all(self, hashes: Sequence[int]) -> Mapping[str, int]: ...

    def record(self, replica: str, hashes: Sequence[int], now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Matched leading blocks per replica (replicas with none may be left out), and which replicas were scored from
    their own KV events rather than estimated."""

    blocks: Mapping[str, int]
    exact: frozenset[str] = frozenset()


class RequestMatcher(PrefixMatcher, Protocol):
    """A matcher that reads the whole request (pools.exact_index.HybridMatcher: exact block hashes where a replica's
    KV-event view is fresh, approximate ones elsewhere). PrefixAffinity uses these methods when present."""

    def match_request(self, request: RoutingRequest, replicas: Sequence[str]) -> PrefixMatch: ...

    def record_request(self, request: RoutingRequest, replica: str, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class ChoiceParams:
    """Tunables of the filters, the TTFT model and the picker (defaults are starting points, see the loadtests)."""

    stale_after_s: float = 10.0  # metrics older than this: the replica counts as saturated
    kv_saturated: float = 0.98  # kv_cache_usage_perc at or above: saturated (preemptions are near)
    max_waiting: float = 32.0  # num_requests_waiting above: saturated
    chunk_tokens: int = 8192  # vLLM --max-num-batched-tokens: tokens one engine step can take
    load_epsilon: float = 1.0  # bounded load, a guard against pile-ups: load + 1 ≤ (1 + ε)·mean + c ...
    load_slack: float = 8.0  # ... with c = load_slack (in requests); queues move prefixes (placement.py)
    near_best_factor: float = 1.1  # without any cache hit, replicas within factor·best + slack are equivalent
    near_best_slack_s: float = 0.02
    max_sessions: int = 100_000
    session_ttl_s: float = 3600.0
    pool_prefill_rate: bool = True  # predict prefill at the pool's fastest observed s/token (see prefill_rate)
    queue_uncached_alpha: float | None = 0.2  # EWMA weight of the uncached share of what was sent to a replica,
    # which scales the queue ahead's tokens (see PrefixAffinity); None: count queued prompts whole
    weights: Mapping[str, float] = field(default_factory=lambda: {"ttft": 1.0, "kv_headroom": 0.1, "balance": 0.1})
    session_ttft_factor: float = 1.5  # a session also keeps its replica while its TTFT ≤ factor·best + slack (its
    session_slack_s: float = 0.05  # history is there even where the prefix index does not know it)
    placement_window_s: float = 3.0  # overload must persist this long (exponential window) to move a prefix
    move_cost_factor: float = 0.25  # a move must save its recompute plus this × it again: the displaced KV (inf: never)
    shortlist_above: int = 32  # prefix_affinity scores every replica of a pool this large or smaller; of a larger
    shortlist_sample: int = 8  # one, the prefix's holders and sessions' replicas plus this many more (`shortlist`)


@dataclass(slots=True)
class Candidate:
    """A replica that passed the hard filters, with what the policy estimated for this request.

    Read-only by convention; not frozen because a frozen dataclass is 5x slower to build, on the hot path."""

    url: str
    replica: ReplicaSnapshot
    saturated: bool
    matched_blocks: int
    uncached_tokens: int
    predicted_ttft_s: float
    load: float  # requests on it, for the bounded-load rule
    source: str = ""  # where matched_blocks came from with a RequestMatcher: "exact" or "approx"
    queue_s: float = 0.0  # predicted wait before this request's own prefill starts
    prefill_s: float = 0.0  # its own prefill there (the uncached part), on an otherwise idle replica


# ---------------------------------------------------------------------------------------------------------------
# Filters


def routable(replica: ReplicaSnapshot) -> bool:
    """Hard filter: only healthy, non-draining replicas may take new work."""
    return replica.healthy and not replica.draining


def metrics_fresh(replica: ReplicaSnapshot, params: ChoiceParams) -> bool:
    """Scraped numbers are usable: present and younger than stale_after_s."""
    return replica.metrics_age_s is not None and replica.metrics_age_s <= params.stale_after_s


def saturation(replica: ReplicaSnapshot, params: ChoiceParams) -> str | None:
    """Soft filter: why a replica should not get new work if another can ("stale_metrics", "kv_full",
    "queue_full"), or None. A replica never scraped is not saturated: nothing says it is loaded, and its in-flight
    count still is."""
    if replica.metrics_age_s is not None and replica.metrics_age_s > params.stale_after_s:
        return "stale_metrics"
    if replica.kv_usage is not None and replica.kv_usage >= params.kv_saturated:
        return "kv_full"
    if replica.waiting is not None and replica.waiting > params.max_waiting:
        return "queue_full"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Estimates


def queue_estimate(replica: ReplicaSnapshot, params: ChoiceParams) -> tuple[float, float]:
    """(requests waiting ahead, requests decoding) on the replica.

    Scrapes lag; the gateway's in-flight count does not. In-flight requests beyond what the replica reports running
    must still be waiting (or were just sent), so waiting = max(scraped waiting, in_flight − running). Without fresh
    metrics, assume everything in flight is running and nothing else is there.
    """
    running = replica.running
    if running is None or not metrics_fresh(replica, params):
        return 0.0, float(replica.in_flight)
    waiting = replica.waiting or 0.0
    beyond = replica.in_flight - running
    return (beyond if beyond > waiting else waiting), (running if running > 0.0 else 0.0)


def predict_ttft(
    replica: ReplicaSnapshot,
    uncached_tokens: int,
    waiting: float,
    running: float,
    tokens_per_waiting: float,
    chunk_tokens: int,
    s_per_token: float | None = None,
) -> float:
    """Seconds to first token: prefill of the queue ahead and of our uncached tokens, one engine step at a time.

    Each chunked-prefill step takes up to chunk_tokens tokens, minus one decode token per running request, and the
    steps also decode the running requests, which costs about one TPOT each. `s_per_token`: the prefill rate to use
    (default: the replica's own estimate).
    """
    work = waiting * tokens_per_waiting + (uncached_tokens if uncached_tokens > 1 else 1)
    seconds = work * (replica.prefill_s_per_token if s_per_token is None else s_per_token)
    if running > 0:
        per_step = chunk_tokens - running
        if per_step < chunk_tokens / 8:
            per_step = chunk_tokens / 8
        seconds += math.ceil(work / per_step) * replica.tpot_s
    return seconds


def prefill_rate(replicas: Sequence[ReplicaSnapshot]) -> float:
    """The pool's prefill seconds per uncached token: the lowest of its replicas' estimates.

    Each replica's estimate is an EWMA of TTFT / uncached prompt tokens, so it also holds the time the request
    queued, and a cache hit (a few uncached tokens behind a queue) inflates it tenfold: a replica that just served
    hits would look slowest and be avoided exactly where the cache is. The queue is modelled apart (predict_ttft),
    so the rate wanted is the engines' compute rate, which the replicas of a pool (one model, one launch recipe)
    share; the least inflated estimate is the closest to it.
    """
    return min((r.prefill_s_per_token for r in replicas if r.healthy and not r.draining), default=60e-6)


def load_of(replica: ReplicaSnapshot, params: ChoiceParams) -> float:
    """Requests on the replica for the bounded-load rule: ours in flight, or what it reports when that is more."""
    running = replica.running
    if running is None or not metrics_fresh(replica, params):
        return float(replica.in_flight)
    reported = running + (replica.waiting or 0.0)
    return reported if reported > replica.in_flight else float(replica.in_flight)


def _replica_state(replica: ReplicaSnapshot, params: ChoiceParams) -> tuple[float, float, bool, float]:
    """`queue_estimate`'s (waiting, running), whether `saturation` finds a reason, and `load_of`, in one pass over
    the replica's fields (each candidate of every request needs all four)."""
    in_flight = replica.in_flight
    age = replica.metrics_age_s
    scraped_waiting = replica.waiting
    kv_usage = replica.kv_usage
    saturated = (age is not None and age > params.stale_after_s) or (
        kv_usage is not None and kv_usage >= params.kv_saturated) or (
        scraped_waiting is not None and scraped_waiting > params.max_waiting)
    running = replica.running
    if running is None or age is None or age > params.stale_after_s:
        return 0.0, float(in_flight), saturated, float(in_flight)
    waiting = scraped_waiting or 0.0
    beyond = in_flight - running
    reported = running + waiting
    return ((beyond if beyond > waiting else waiting), (running if running > 0.0 else 0.0), saturated,
            reported if reported > in_flight else float(in_flight))


def _keep_full_holders(candidates: list[Candidate], params: ChoiceParams) -> None:
    """A replica saturated only because its KV is full stays usable for the requests whose longest cached prefix it
    holds: it must write only their uncached part, while any other replica writes all of it, evicting what someone
    else will miss; and vLLM frees blocks as its running requests end. Excluding it under load sent a group's
    requests elsewhere as misses and split the group (loadtests/bench/prefix_load.py near saturation). A persistent
    queue there still moves the prefix (policies/placement.py)."""
    most = max(c.matched_blocks for c in candidates)
    if most <= 0:
        return
    for c in candidates:
        if c.saturated and c.matched_blocks == most:
            r = c.replica
            if metrics_fresh(r, params) and (r.waiting is None or r.waiting <= params.max_waiting):
                c.saturated = False


def _mix(seed: int, i: int) -> int:
    """The i-th of a seed's pseudo-random draws (splitmix64): the same seed draws the same replicas everywhere."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def rendezvous_weight(key: int | str, url: str) -> int:
    """Highest-random-weight hashing: each key ranks replicas the same way everywhere, and only the keys of a
    removed replica move."""
    return xxhash.xxh3_64_intdigest(f"{key}\x00{url}".encode())


# ---------------------------------------------------------------------------------------------------------------
# Scorers: candidates → one score in 0..1 each, higher is better.

Scorer = Callable[[Sequence[Candidate]], list[float]]


def score_ttft(candidates: Sequence[Candidate]) -> list[float]:
    """best TTFT / this TTFT: 1 for the fastest, ½ for one twice as slow."""
    best = min(c.predicted_ttft_s for c in candidates)
    return [(best + 1e-3) / (c.predicted_ttft_s + 1e-3) for c in candidates]


def score_kv_headroom(candidates: Sequence[Candidate]) -> list[float]:
    """Free KV cache: a fuller replica is closer to evicting what it caches and to preempting. Unknown → ½."""
    return [0.5 if c.replica.kv_usage is None else _clamp01(1.0 - c.replica.kv_usage) for c in candidates]


def score_balance(candidates: Sequence[Candidate]) -> list[float]:
    """Fewest tokens in flight from this gateway (fresh to the request, unlike scrapes): min / this."""
    least = min(c.replica.in_flight_tokens for c in candidates)
    return [(least + 1.0) / (c.replica.in_flight_tokens + 1.0) for c in candidates]


def _clamp01(value: float) -> float:
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


SCORERS: dict[str, Scorer] = {"ttft": score_ttft, "kv_headroom": score_kv_headroom, "balance": score_balance}


_BUILT_IN_ORDER = {"ttft": 0, "kv_headroom": 1, "balance": 2}


def combine(candidates: Sequence[Candidate], weights: Mapping[str, float]) -> list[float]:
    """Σ weight · clamp(score, 0, 1), as llm-d's scheduler profile does."""
    order = [_BUILT_IN_ORDER.get(name, -1) for name, weight in weights.items() if weight]
    if -1 not in order and order == sorted(order):
        return _combine_built_in(candidates, weights)
    totals = [0.0] * len(candidates)
    for name, weight in weights.items():
        if weight:
            for i, score in enumerate(SCORERS[name](candidates)):
                totals[i] += weight * (score if 0.0 <= score <= 1.0 else _clamp01(score))
    return totals


def _combine_built_in(candidates: Sequence[Candidate], weights: Mapping[str, float]) -> list[float]:
    """`combine` of the built-in scorers, weighted in their own order, in one pass: the same sums (each candidate's
    terms added in the same order), without a list per scorer (this runs on every request)."""
    w_ttft = weights.get("ttft", 0.0)
    w_kv = weights.get("kv_headroom", 0.0)
    w_balance = weights.get("balance", 0.0)
    best = min(c.predicted_ttft_s for c in candidates) + 1e-3 if w_ttft else 0.0
    least = min(c.replica.in_flight_tokens for c in candidates) + 1.0 if w_balance else 0.0
    totals = []
    for c in candidates:
        total = 0.0
        if w_ttft:
            score = best / (c.predicted_ttft_s + 1e-3)
            total += w_ttft * (score if 0.0 <= score <= 1.0 else _clamp01(score))
        if w_kv:
            kv = c.replica.kv_usage
            score = 0.5 if kv is None else _clamp01(1.0 - kv)
            total += w_kv * score
        if w_balance:
            score = least / (c.replica.in_flight_tokens + 1.0)
            total += w_balance * (score if 0.0 <= score <= 1.0 else _clamp01(score))
        totals.append(total)
    return totals


# ---------------------------------------------------------------------------------------------------------------
# Policies


def _routable_or_raise(replicas: Sequence[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
    ok = [r for r in replicas if routable(r)]
    if not ok:
        raise NoReplicaAvailable(replicas[0].pool if replicas else None, len(replicas))
    return ok


class RoundRobin:
    """Each healthy replica in turn: the cache-blind baseline the other policies are compared against."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot], now: float) -> RoutingDecision:
        eligible = sorted(_routable_or_raise(replicas), key=lambda r: r.url)
        start = self._turn % len(eligible)
        self._turn += 1
        ordered = eligible[start:] + eligible[:start]
        return RoutingDecision(
            replica=ordered[0].url,
            fallbacks=tuple(r.url for r in ordered[1:]),
            reason="round_robin",
            predicted_ttft_s=None,
            matched_blocks=0,
            scores={},
        )

    def dispatched(self, request: RoutingRequest, replica: str, now: float) -> None:
        return None


class LeastLoaded:
    """Fewest tokens ahead: the gateway's in-flight tokens plus the requests the replica reports waiting.

    Saturated replicas come last; equal loads rotate so that an idle pool is not served by its first replica only.
    """

    def __init__(self, params: ChoiceParams | None = None) -> None:
        self.params = params or ChoiceParams()
        self._turn = 0

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot], now: float) -> RoutingDecision:
        eligible = _routable_or_raise(replicas)
        loads: dict[str, float] = {}
        for r in eligible:
            waiting, _running = queue_estimate(r, self.params)
            per_request = r.in_flight_tokens / r.in_flight if r.in_flight else request.prompt_tokens
            loads[r.url] = r.in_flight_tokens + waiting * per_request

        def rank(r: ReplicaSnapshot) -> tuple[bool, float]:
            return saturation(r, self.params) is not None, loads[r.url]

        ordered = sorted(eligible, key=lambda r: (rank(r), r.url))
        ties = [r for r in ordered if rank(r) == rank(ordered[0])]
        if len(ties) > 1:
            first = ties[self._turn % len(ties)]
            ordered.remove(first)
            ordered.insert(0, first)
        self._turn += 1
        top = max(loads.values()) or 1.0
        return RoutingDecision(
            replica=ordered[0].url,
            fallbacks=tuple(r.url for r in ordered[1:]),
            reason="least_loaded",
            predicted_ttft_s=None,
            matched_blocks=0,
            scores={url: 1.0 - load / (top + 1.0) for url, load in loads.items()},
        )

    def dispatched(self, request: RoutingRequest, replica: str, now: float) -> None:
        return None


class PrefixAffinity:
    """Prefix placement over time, predicted TTFT from what each replica has cached, sticky sessions.

    The TTFT model's queue ahead counts what the queued requests will really prefill: per replica, an EWMA of the
    uncached share of the requests sent there (from the matched blocks each was routed with: exact ones with precise
    routing) scales their token estimates, so a replica whose queue is made of cache hits is not mistaken for one
    that queues full prompts. Prefill is predicted at the pool's rate (`prefill_rate`).

    Where a request goes is its prefix's placement (policies/placement.py): home (its session's replica, else the
    least queued replica holding its longest prefix) unless a queue persisting there pays for a move.

    Reasons reported: "session" (kept its replica), "affinity_hit" (went where most of its prefix is cached),
    "prefix_move" (home stayed more queued than another replica by more than the move costs), "load_spill" (the
    bounded-load guard), "cold_rendezvous" (no replica holds any of it: rendezvous on its first
    block among the near-best replicas sent the fewest requests lately, so repeats of a new prefix meet),
    "least_loaded" (prompt shorter than a block), "all_saturated" (every replica was saturated; the least bad won).
    With a RequestMatcher (precise routing) an affinity hit says where its match came from: "affinity_hit:exact" (the
    replica's own KV events) or "affinity_hit:approx" (estimated: no exact hashes, or the replica's events are stale).
    """

    def __init__(self, prefix_index: PrefixMatcher | None = None, params: ChoiceParams | None = None,
                 calibrator: TtftCalibrator | None = None) -> None:
        self.prefix_index = prefix_index
        self.params = params or ChoiceParams()
        self.calibrator = calibrator  # the pool's learnt TTFT correction: calibrated median and P90, SLO checks
        unknown = set(self.params.weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorer weights {sorted(unknown)}; known: {sorted(SCORERS)}")
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key → (replica url, last sent)
        self._turn = 0
        self._match_request = getattr(prefix_index, "match_request", None)  # a RequestMatcher's, when it is one
        self._record_request = getattr(prefix_index, "record_request", None)
        self._uncached_share: dict[str, float] = {}  # replica → EWMA of the uncached share of what was sent there
        self._window = QueueWindow(self.params.placement_window_s)  # each replica's queue, its persistent part
        self._sends = DispatchRate()  # requests sent to each replica lately: where new prefixes find room
        self._groups = DispatchRate(self.params.placement_window_s, max_replicas=65_536)  # each cached prefix's rate
        self._arrivals = DispatchRate(self.params.placement_window_s)  # each replica's, on the placement's time scale
        self._last: tuple[RoutingRequest, list[Candidate]] | None = None  # the last choice, for dispatched
        self._matched: tuple[RoutingRequest, Mapping[str, int]] | None = None  # the shortlist's index match

    def shortlist(self, request: RoutingRequest, urls: Collection[str]) -> list[str] | None:
        """The replicas worth scoring in a pool of more than `shortlist_above` (None: every one), so that a decision
        costs the same in a pool of a thousand: the `shortlist_sample` replicas holding most of the request's prefix
        (the prefix index), its session's replica, and `shortlist_sample` more drawn at random (power of k choices:
        the least loaded of a few is nearly as good as the least loaded of all). The draw is seeded by the prompt's
        first block, so repeats of a prefix no replica holds yet meet on the same few; prompts shorter than a block
        draw afresh each time. A precise pool's matcher reads every replica: not shortlisted."""
        params = self.params
        count = len(urls)
        if count <= params.shortlist_above or self._match_request is not None:
            return None
        pool = urls if isinstance(urls, Sequence) else list(urls)
        picked: dict[str, None] = {}
        hashes = request.block_hashes
        if self.prefix_index is not None and hashes:
            matches = self.prefix_index.match_all(hashes)
            self._matched = (request, matches)
            best = sorted(matches.items(), key=lambda item: -item[1])[:params.shortlist_sample] \
                if len(matches) > params.shortlist_sample else matches.items()
            picked.update((url, None) for url, _ in best)
        if request.session_key is not None:
            entry = self._sessions.get(request.session_key)
            if entry is not None:
                picked[entry[0]] = None
        if hashes:
            seed = hashes[0]
        else:
            seed = self._turn
            self._turn += 1
        for i in range(params.shortlist_sample):
            picked[pool[_mix(seed, i) % count]] = None
        return list(picked)

    def candidates(self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]) -> list[Candidate]:
        """The hard filter and every estimate, for choose() and for the admin API's "explain"."""
        params = self.params
        matches: Mapping[str, int] = {}
        exact: frozenset[str] | None = None
        if self._match_request is not None:
            found = self._match_request(request, [r.url for r in replicas if r.healthy and not r.draining])
            matches, exact = found.blocks, found.exact
        elif self.prefix_index is not None and request.block_hashes:
            matched = self._matched
            matches = matched[1] if matched is not None and matched[0] is request else \
                self.prefix_index.match_all(request.block_hashes)
        out: list[Candidate] = []
        prompt_tokens = request.prompt_tokens
        chunk_tokens = params.chunk_tokens
        rate = prefill_rate(replicas) if params.pool_prefill_rate else None
        shares = self._uncached_share if params.queue_uncached_alpha is not None else {}
        for r in replicas:
            if not r.healthy or r.draining:
                continue
            url = r.url
            matched = matches.get(url, 0)
            uncached = prompt_tokens - matched * r.block_size
            waiting, running, saturated, load = _replica_state(r, params)
            per_waiting = r.in_flight_tokens / r.in_flight if r.in_flight else float(prompt_tokens)
            if shares:
                per_waiting *= shares.get(url, 1.0)
            ttft = predict_ttft(r, uncached, waiting, running, per_waiting, chunk_tokens, rate)
            alone = predict_ttft(r, uncached, 0.0, running, 0.0, chunk_tokens, rate) if waiting else ttft
            # the wait ahead: the replica's queue as scraped, or the prompts this gateway sent it that have not
            # reached a first token (vLLM counts a prompt being prefilled in chunks as running, not waiting)
            backlog = r.prefill_tokens * (r.prefill_s_per_token if rate is None else rate)
            queue = ttft - alone
            if backlog > queue:
                queue, ttft = backlog, backlog + alone
            source = "" if exact is None else "exact" if url in exact else "approx"
            out.append(Candidate(url, r, saturated, matched, max(uncached, 0), ttft, load, source, queue, alone))
        if not out:
            raise NoReplicaAvailable(replicas[0].pool if replicas else None, len(replicas))
        if matches:
            _keep_full_holders(out, params)
        return out

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot], now: float) -> RoutingDecision:
        params = self.params
        everyone = self.candidates(request, replicas)
        usable = [c for c in everyone if not c.saturated] or everyone
        all_saturated = len(usable) == len(everyone) and everyone[0].saturated
        scores = combine(usable, params.weights)
        score_of = {c.url: s for c, s in zip(usable, scores, strict=True)}
        ranked = sorted(usable, key=lambda c: (-score_of[c.url], c.url))

        chosen, reason = self._placed(request, usable, ranked, now)
        if all_saturated:
            reason = "all_saturated"
        elif reason == "affinity_hit" and chosen.source:
            reason = f"affinity_hit:{chosen.source}"  # exact (the replica's KV events) or approx (estimated)
        predicted, p90, runner_up, features, slo_met, plan = chosen.predicted_ttft_s, None, None, None, None, None
        if self.calibrator is not None:
            chosen, reason, predicted, p90, runner_up, features, slo_met, plan = self._calibrated(
                request, usable, chosen, reason)

        if params.queue_uncached_alpha is not None:
            self._last = (request, everyone)
        rest = [c for c in ranked if c is not chosen]
        if not all_saturated:  # saturated replicas are still worth a retry, last
            rest += sorted((c for c in everyone if c.saturated), key=lambda c: c.predicted_ttft_s)
        return RoutingDecision(
            replica=chosen.url,
            fallbacks=tuple(c.url for c in rest),
            reason=reason,
            predicted_ttft_s=predicted,
            matched_blocks=chosen.matched_blocks,
            scores=score_of,
            predicted_ttft_p90_s=p90,
            runner_up_ttft_s=runner_up,
            features=features,
            slo_met=slo_met,
            predicted_tpot_s=chosen.replica.tpot_s,
            prefill_plan=plan,
        )

    def _plan(self, c: Candidate, stretch: float = 1.0) -> tuple[float, int, float]:
        """The replica's step plan for this request; its TTFT is the calibrated median. The replica's virtual step
        clock (policies/latency_model.prefill_plan) at the pool's learnt engine cost: when this request's prefill step
        would start and end, given what this gateway sent the replica and when. Requests the replica reports waiting
        beyond all this gateway has in flight there (other gateways') count as this request's size each.
        `stretch`: the planned step lasts this many times longer (`_clock_ttfts`)."""
        r = c.replica
        assert self.calibrator is not None
        cost = self.calibrator.cost
        uncached = c.uncached_tokens
        ends_in = r.step_ends_in if stretch == 1.0 else \
            r.step_starts_in + (r.step_ends_in - r.step_starts_in) * stretch
        plan = prefill_plan(cost, r.step_starts_in, ends_in, r.step_tokens, uncached, r.prefill_tokens)
        others = (r.waiting or 0.0) - r.in_flight
        if others > 0.0:  # unseen work ahead: it delays the step, without changing what the step holds
            extra = others * cost.seconds(uncached)
            return plan[0] + extra, plan[1], plan[2] + extra
        return plan

    def _features(self, c: Candidate) -> tuple[tuple[float, ...], tuple[float, int, float]]:
        """The calibrated model's inputs (for the P90) and the replica's step plan."""
        plan = self._plan(c)
        r = c.replica
        waiting, running = queue_estimate(r, self.params)
        return ttft_features(plan[2], c.uncached_tokens, waiting, running, r.kv_usage), plan

    def _calibrated(
        self, request: RoutingRequest, usable: Sequence[Candidate], chosen: Candidate, reason: str
    ) -> tuple[Candidate, str, float, float, float | None, tuple[float, ...], bool | None, tuple[float, int, float]]:
        """The chosen replica's calibrated TTFT (median, P90) and the runner-up's median; with an SLO, a move to a
        replica predicted to meet it when the chosen one is predicted to miss it (the cache-affine choice stays
        whenever it meets the SLO). Only the chosen and runner-up are calibrated unless an SLO is at risk: the
        decision's cost stays close to the analytic model's."""
        calibrator = self.calibrator
        assert calibrator is not None
        features, plan = self._features(chosen)
        median, p90 = calibrator.predict(features)
        others = [c for c in usable if c is not chosen]
        runner = min(others, key=lambda c: c.predicted_ttft_s) if others else None
        runner_up = self._plan(runner)[2] if runner is not None else None  # the median is the plan's TTFT
        ttft_slo, tpot_slo = request.ttft_slo_s, request.tpot_slo_s
        if ttft_slo is None and tpot_slo is None:
            return chosen, reason, median, p90, runner_up, features, None, plan

        def meets(c: Candidate, p90_s: float) -> bool:
            return (ttft_slo is None or p90_s <= ttft_slo) and (tpot_slo is None or c.replica.tpot_s <= tpot_slo)

        if meets(chosen, p90):
            return chosen, reason, median, p90, runner_up, features, True, plan
        for c in sorted(others, key=lambda c: c.predicted_ttft_s):
            x, c_plan = self._features(c)
            c_median, c_p90 = calibrator.predict(x)
            if meets(c, c_p90):
                return c, "slo_move", c_median, c_p90, median, x, True, c_plan
        return chosen, reason, median, p90, runner_up, features, False, plan

    def dispatched(self, request: RoutingRequest, replica: str, now: float) -> None:
        """The request went to `replica`: its blocks are there now, its session follows it, and the replica's
        queue now holds its uncached share."""
        last = self._last
        alpha = self.params.queue_uncached_alpha
        if last is not None and last[0] is request and alpha is not None:
            chosen = next((c for c in last[1] if c.url == replica), None)
            if chosen is not None:
                share = chosen.uncached_tokens / request.prompt_tokens if request.prompt_tokens > 0 else 1.0
                shares = self._uncached_share
                before = shares.get(replica, 1.0)
                shares[replica] = before + alpha * (share - before)
                if len(shares) > _MAX_SHARES:  # replicas come and go with discovery: keep the recent ones
                    del shares[next(iter(shares))]
        self._sends.sent(replica, now)
        self._arrivals.sent(replica, now)
        if self._record_request is not None:
            self._record_request(request, replica, now)
        elif self.prefix_index is not None and request.block_hashes:
            self.prefix_index.record(replica, request.block_hashes, now)
        if request.session_key is not None:
            sessions = self._sessions
            sessions[request.session_key] = (replica, now)
            sessions.move_to_end(request.session_key)
            while len(sessions) > self.params.max_sessions:
                sessions.popitem(last=False)

    def session_replica(self, session_key: str) -> str | None:
        """Where a session last went (admin API, tests)."""
        entry = self._sessions.get(session_key)
        return entry[0] if entry else None

    # -- picker steps -------------------------------------------------------------------------------------------

    def _placed(self, request: RoutingRequest, usable: Sequence[Candidate], ranked: Sequence[Candidate],
                now: float) -> tuple[Candidate, str]:
        """The placement rule (policies/placement.py): home unless a persistent queue pays for a move; a new prefix
        where homed groups bring back the least traffic; the bounded-load guard."""
        averages = {c.url: self._window.observe(c.url, c.queue_s, now) for c in usable}
        home, reason = self._home(request, usable, max(c.matched_blocks for c in usable), now)
        if home is None:
            chosen, reason = self._preferred(request, ranked, now)
        else:
            chosen = self._moved(home, usable, averages, reason == "session", self._later(request, home, now), now)
            if chosen is not home:
                reason = "prefix_move"
        bound = self._load_bound([c.load for c in usable])
        if chosen.load + 1.0 > bound:
            spill = next((c for c in ranked if c.load + 1.0 <= bound), None)
            if spill is not None:
                chosen, reason = spill, "load_spill"
        return chosen, reason

    def _later(self, request: RoutingRequest, home: Candidate, now: float) -> float:
        """The requests of the request's group expected within the placement window after it. The group is the
        prefix home holds, named by its last block (exact hashes on precise pools)."""
        hashes = request.exact_block_hashes if home.source == "exact" else request.block_hashes
        depth = min(home.matched_blocks, len(hashes))
        if not depth:
            return 0.0
        return self._groups.sent(hashes[depth - 1], now) * self.params.placement_window_s - 1.0

    def _home(self, request: RoutingRequest, usable: Sequence[Candidate], most_matched: int,
              now: float) -> tuple[Candidate | None, str]:
        """Where the request belongs (policies/placement.py): its session's replica while that holds its longest
        cached prefix, else the least queued of the replicas that hold it; None when no replica holds any of it."""
        if request.session_key is not None:
            entry = self._sessions.get(request.session_key)
            if entry is not None and now - entry[1] <= self.params.session_ttl_s:
                previous = next((c for c in usable if c.url == entry[0]), None)
                if previous is not None and previous.matched_blocks >= most_matched:
                    return previous, "session"
        if most_matched <= 0:
            return None, ""
        holders = [c for c in usable if c.matched_blocks == most_matched]
        return min(holders, key=lambda c: (c.predicted_ttft_s, c.url)), "affinity_hit"

    def _moved(self, home: Candidate, usable: Sequence[Candidate], averages: Mapping[str, float],
               session: bool, later: float, now: float) -> Candidate:
        """Home, unless another replica is persistently less queued by more than the move costs, spread over the
        `later` requests of the group due within the window (policies/placement.should_move): the one whose TTFT
        plus the move's displacement cost is least. The move's cost also counts the target's requests that wait
        behind its extra prefill. A session's
        replica also holds history the index may not know of: it is left only for a TTFT beyond session_ttft_factor
        × the other's + session_slack_s."""
        params = self.params
        factor = params.move_cost_factor
        if math.isinf(factor) or len(usable) < 2:
            return home
        home_prefill = home.prefill_s

        def extra(c: Candidate) -> float:
            return c.prefill_s - home_prefill

        others = [c for c in usable if c is not home]
        other = min(others, key=lambda c: (c.predicted_ttft_s + move_cost_s(extra(c), factor), c.url))
        limit = params.session_ttft_factor * other.predicted_ttft_s + params.session_slack_s
        if session and home.predicted_ttft_s <= limit:
            return home
        # the requests the target takes while the move's extra prefill is still ahead of them: as long as its
        # backlog lasts (its windowed queue) plus the extra itself, at the rate it is sent requests
        delayed = self._arrivals.rate(other.url, now) * (max(averages[other.url], 0.0) + max(extra(other), 0.0))
        if should_move((home.queue_s, averages[home.url]), (other.queue_s, averages[other.url]), extra(other),
                       factor, later, delayed):
            return other
        return home

    def _preferred(self, request: RoutingRequest, ranked: Sequence[Candidate], now: float) -> tuple[Candidate, str]:
        """No replica holds any of the prompt: the near-best ones are interchangeable; of those, the ones sent the
        fewest requests lately (the prefixes homed there come back), and rendezvous hashing on the first block (or,
        with no block at all, rotation) chooses among them, so repeats of a new prefix meet.

        "Near-best" reads the replicas' step clocks where the pool has a calibrator (`_clock_ttfts`): a whole
        prompt is prefilled here, and a replica whose last prefill ends in 0.2 s is not the same as one whose
        prefill just began, though both have one prompt outstanding (the analytic TTFT counts outstanding tokens,
        not how far along they are). Without the clock, or for a prompt shorter than a block (its prefill is a
        step's), the analytic TTFT."""
        clocked = self.calibrator is not None and len(ranked) > 1 and bool(request.block_hashes)
        ttfts = self._clock_ttfts(ranked) if clocked else [c.predicted_ttft_s for c in ranked]
        limit = min(ttfts) * self.params.near_best_factor + self.params.near_best_slack_s
        near = [c for c, ttft in zip(ranked, ttfts, strict=True) if ttft <= limit]
        if len(near) > 1:
            room = set(self._sends.least_used([c.url for c in near], now))
            near = [c for c in near if c.url in room]
        if request.block_hashes:
            key = request.block_hashes[0]
            return max(near, key=lambda c: rendezvous_weight(key, c.url)), "cold_rendezvous"
        turn = self._turn
        self._turn += 1
        return near[turn % len(near)], "least_loaded"

    def _clock_ttfts(self, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's TTFT by its step clock. A step past its planned end whose first token has not come says
        the engine runs slower than the learnt cost (a fresh pool's first seconds, a slow spell): every clock is
        stretched by the most overdue step's elapsed ÷ planned time, plus a tenth, capped at 4× (a stalled replica
        must not set every clock), so that replicas keep their order — the step begun first ends first."""
        stretch = 1.0
        for c in candidates:
            r = c.replica
            span = r.step_ends_in - r.step_starts_in
            if r.prefill_tokens > 0 and r.step_ends_in < 0.0 and span > 0.0:
                ratio = -r.step_starts_in / span
                if ratio > stretch:
                    stretch = ratio
        if stretch > 1.0:
            stretch = min(stretch * 1.1, 4.0)
        return [self._plan(c, stretch)[2] for c in candidates]

    def _load_bound(self, loads: Sequence[float]) -> float:
        """Consistent hashing with bounded loads: after taking this request, no replica may carry more than
        (1 + ε)·mean + c requests, the mean including this one. The guard where no queue is measured (replicas
        without fresh metrics predict no wait) and what spreads requests onto a replica that joins a pool with no
        queue to relieve."""
        mean_after = (sum(loads) + 1.0) / len(loads)
        return (1.0 + self.params.load_epsilon) * mean_after + self.params.load_slack


_MAX_SHARES = 4096


def build_policy(name: PolicyName, **params: Any) -> ReplicaPolicy:
    """The policy named in config (`routing.policy`).

    prefix_affinity takes `prefix_index=` (a pools.prefix_index.PrefixIndex; without one it still balances on
    predicted TTFT, just without cache hits) and `calibrator=` (the pool's policies.latency_model.TtftCalibrator:
    calibrated predictions and SLO-aware moves); least_loaded and prefix_affinity take `params=ChoiceParams(...)` or
    its fields as keywords (e.g. `load_epsilon=0.5`).
    """
    prefix_index = params.pop("prefix_index", None)
    calibrator = params.pop("calibrator", None)
    choice_params = params.pop("params", None)
    if params:
        choice_params = ChoiceParams(**params) if choice_params is None else replace(choice_params, **params)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(choice_params)
    if name == "prefix_affinity":
        return PrefixAffinity(prefix_index=prefix_index, params=choice_params, calibrator=calibrator)
    raise ValueError(f"unknown routing policy {name!r}")
