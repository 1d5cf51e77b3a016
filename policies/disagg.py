"""Prefill/decode disaggregation decisions: pure, no I/O (the gateway's `gateway/disagg.py` acts on them).

Three decisions per request to a disaggregated pool:

1. **The decider** (`decide`): disaggregate, or send the request straight to a decode replica, which then prefills
   it itself. As llm-d's prefix-based P/D decider: what counts is the prompt's *uncached* length on the decode
   replica it would go to; below `min_uncached_tokens` a remote prefill costs more (an extra request, a KV pull, a
   second scheduling) than the few prefill chunks it would take out of the decode batch.
2. **The prefill replica**: the pool's ordinary replica policy (prefix affinity, approximate or precise) over the
   prefill replicas: its TTFT model already prices the uncached share and the queue ahead of it.
3. **The decode replica** (`rank_decode`): decode load and KV headroom. The whole prompt's blocks land on the decode
   replica (pulled, then decoded from), plus the output, so a replica that cannot hold them soon preempts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from policies.snapshot import (
    NoReplicaAvailable,
    ReplicaSnapshot,
    RoutingDecision,
    RoutingRequest,
)

# The decider's outcomes (the `path` label of m3gate_pd_decisions_total).
DISAGGREGATED = "disaggregated"
DECODE_SHORT = "decode_short"  # the whole prompt is shorter than min_uncached_tokens
DECODE_CACHED = "decode_cached"  # long, but the decode replica caches all but fewer than min_uncached_tokens
DECODE_NO_PREFILL = "decode_no_prefill"  # no prefill replica available: the decode replica prefills
DECODE_UNSUPPORTED = "decode_unsupported"  # an API whose requests vLLM does not transfer (responses, messages)
PATHS = (DISAGGREGATED, DECODE_SHORT, DECODE_CACHED, DECODE_NO_PREFILL, DECODE_UNSUPPORTED)
KV_TRANSFER_APIS = frozenset({"chat", "completions"})  # the OpenAI endpoints vLLM's connector acts on


@dataclass(frozen=True, slots=True)
class PDDecision:
    path: str  # one of PATHS
    uncached_tokens: int  # the prompt's tokens not cached on the decode replica it would go to

    @property
    def disaggregated(self) -> bool:
        return self.path == DISAGGREGATED


def decide(
    prompt_tokens: int, decode_cached_tokens: int, min_uncached_tokens: int, prefill_available: bool,
    api: str = "chat",
) -> PDDecision:
    """Disaggregate a request only when its uncached prompt is long enough to pay for the KV transfer."""
    uncached = max(0, prompt_tokens - max(0, decode_cached_tokens))
    if api not in KV_TRANSFER_APIS:
        return PDDecision(DECODE_UNSUPPORTED, uncached)
    if uncached < min_uncached_tokens:
        return PDDecision(DECODE_SHORT if prompt_tokens < min_uncached_tokens else DECODE_CACHED, uncached)
    if not prefill_available:
        return PDDecision(DECODE_NO_PREFILL, uncached)
    return PDDecision(DISAGGREGATED, uncached)


@dataclass(frozen=True, slots=True)
class DecodeParams:
    load_weight: float = 1.0  # decode load: requests running + waiting (or in flight from here, when more)
    kv_weight: float = 1.0  # KV headroom left after the request's blocks land
    kv_saturated: float = 0.98  # kv_cache_usage_perc at or above: last resort
    stale_after_s: float = 10.0  # older scrapes are not trusted (in-flight counts are)


def decode_load(replica: ReplicaSnapshot, params: DecodeParams) -> float:
    """Requests on the replica: what it reports (running + waiting) when fresh and larger, else ours in flight."""
    fresh = replica.metrics_age_s is not None and replica.metrics_age_s <= params.stale_after_s
    if replica.running is None or not fresh:
        return float(replica.in_flight)
    reported = replica.running + (replica.waiting or 0.0)
    return max(reported, float(replica.in_flight))


def kv_headroom(replica: ReplicaSnapshot, blocks_needed: int) -> float | None:
    """Share of the replica's KV cache left free once `blocks_needed` more blocks land; negative when they do not
    fit; None when its capacity or usage is unknown."""
    if not replica.kv_blocks or replica.kv_usage is None:
        return None
    free = replica.kv_blocks * (1.0 - replica.kv_usage) - blocks_needed
    return free / replica.kv_blocks


def _rendezvous(key: int | str, url: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}\x00{url}".encode())


def blocks_for(tokens: int, block_size: int) -> int:
    return max(1, math.ceil(tokens / max(1, block_size)))


def rank_decode(
    request: RoutingRequest, replicas: Sequence[ReplicaSnapshot], params: DecodeParams | None = None,
) -> RoutingDecision:
    """The decode replica for a disaggregated request, and the rest in order (retries). Score = load_weight ·
    (least load + 1) / (load + 1) + kv_weight · headroom after the prompt and expected output land; replicas the
    blocks would not fit, or whose KV is saturated, come last. Equal scores: fewest tokens in flight, then rendezvous
    hashing on the prompt's first block."""
    params = params or DecodeParams()
    usable = [r for r in replicas if r.healthy and not r.draining]
    if not usable:
        raise NoReplicaAvailable(replicas[0].pool if replicas else None, len(replicas), "no decode replica")
    tokens = request.prompt_tokens + request.expected_output
    key: int | str = request.block_hashes[0] if request.block_hashes else (request.session_key or "")
    loads = {r.url: decode_load(r, params) for r in usable}
    least = min(loads.values())
    scored: list[tuple[bool, float, int, str]] = []
    scores: dict[str, float] = {}
    for r in usable:
        headroom = kv_headroom(r, blocks_for(tokens, r.block_size))
        fits = headroom is None or headroom >= 0.0
        full = r.kv_usage is not None and r.kv_usage >= params.kv_saturated
        kv_score = 0.5 if headroom is None else min(1.0, max(0.0, headroom))
        score = params.load_weight * (least + 1.0) / (loads[r.url] + 1.0) + params.kv_weight * kv_score
        scores[r.url] = score
        # equal scores (idle replicas): a hash of the prompt's first block spreads requests, and keeps one
        # conversation's turns on the replica that holds its blocks (its later, shorter turns come straight here)
        scored.append((not fits or full, -round(score, 9), r.in_flight_tokens, -_rendezvous(key, r.url), r.url))
    ordered = [url for *_, url in sorted(scored)]
    last_resort = scored and min(scored)[0]
    return RoutingDecision(
        replica=ordered[0], fallbacks=tuple(ordered[1:]),
        reason="decode_kv_full" if last_resort else "decode_load_kv",
        predicted_ttft_s=None, matched_blocks=0, scores=scores,
    )
