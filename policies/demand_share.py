"""One gateway's share of the demand behind the capacity signal, as it is published to the other gateways sharing
Redis (`state: redis`), and how the live gateways' shares are merged, so that every gateway sizes the pools from the
same demand: the one a single gateway would measure if it saw all the traffic.

What a share holds, per (pool, class): the arrival rate over the gateway's `capacity.window_s` (its window's
arrivals ÷ its span), the window's sums (requests finished and answered, prompt, cached and output tokens, the
gateway's own token estimates) and the requests waiting in its queue now; per (pool, role): the uncached prompt tokens
it sent to the replicas that have not reached their first token; per pool: the engine costs it learnt; per (pool,
role): its signal's memory (`Stabilizer`), so that a gateway starting next to running ones joins their figure; per
pool: the arrival rate's slope over the window and its variance; per (pool, class): the TTFT and TPOT p95 it measured
recently.

Merging, which is why the gateways agree:
- rates, sums, queued requests and prefill backlogs add up (each request reached exactly one gateway);
- token-mix means are taken from the summed sums (a weighted mean over the gateways, as one gateway would see it);
- engine costs: each coefficient of the prefill step (a, c) and of the decode step (d0, d1, d2) is the mean over the
  gateways weighted by the samples behind it (at most `COST_MEMORY`, the learners' forgetting horizon: a gateway that
  learnt for a day does not outweigh one that learnt for the last minute); KV per replica is the smallest reported
  (the replicas are the same for all). Every gateway uses the merged costs for the signal, its own for routing;
- signal memory: the largest desired count and its history, used only to seed a gateway that has none yet;
- slopes and their variances add up (a sum of independent arrival processes); measured p95s: the largest (a class
  at risk behind any gateway is at risk).

JSON has no infinity (orjson writes null, which reads as "too few requests seen"): a measured p95 that is infinite
(a class whose requests were refused for want of capacity) travels as the string "inf", which older readers'
`float()` reads as infinity too. The output tokens' sum of squares (the answers' spread, for the wait for a batch
slot) travels under its own key, which older readers ignore.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

WIRE_VERSION = 1
N_SUMS = 6  # finished, answered, prompt, cached, output, estimated (gateway/capacity/signal.py's per-interval sums)
COST_MEMORY = 200.0  # ≈ 1 / (1 − forget) of PrefillCost and DecodeCost: the samples a learnt cost still rests on

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class CostShare:
    """A pool's engine costs as one gateway learnt them (policies/latency_model.py's PrefillCost, DecodeCost)."""

    prefill: tuple[float, float] = (0.02, 0.06)  # step seconds, seconds per 1K uncached tokens
    prefill_samples: float = 0.0
    decode: tuple[float, float, float] = (0.02, 2e-4, 2e-5)  # d0, d1 per sequence, d2 per sequence per 1K context
    decode_samples: float = 0.0
    kv_tokens: int | None = None  # KV blocks × block size per replica (smallest); None: unknown


@dataclass(frozen=True, slots=True)
class StableShare:
    """A pool role's `Stabilizer` as published: the count asked for, how long ago it last changed, and the counts the
    measured demand needed within the stabilization window as (age_s, replicas)."""

    desired: int
    since_change_s: float
    history: tuple[tuple[float, int], ...] = ()


@dataclass(slots=True)
class DemandShare:
    rates: dict[Key, float] = field(default_factory=dict)  # (pool, class) → arrivals per second
    sums: dict[Key, list[float]] = field(default_factory=dict)  # (pool, class) → the window's N_SUMS sums
    queued: dict[Key, float] = field(default_factory=dict)  # (pool, class) → waiting in the gateway's queue now
    backlog: dict[Key, float] = field(default_factory=dict)  # (pool, role) → uncached tokens not yet prefilled
    costs: dict[str, CostShare] = field(default_factory=dict)  # pool → learnt engine costs
    stable: dict[Key, StableShare] = field(default_factory=dict)  # (pool, role) → the signal's memory
    trends: dict[str, tuple[float, float]] = field(default_factory=dict)  # pool → arrival rate's (slope, variance)
    latency: dict[Key, tuple[float | None, float | None]] = field(default_factory=dict)  # (pool, class) → measured
    # recent TTFT and TPOT p95 (seconds; None: too few requests seen; inf: refused for want of capacity)
    output_sq: dict[Key, float] = field(default_factory=dict)  # (pool, class) → the window's Σ output tokens²
    gateways: int = 1  # how many gateways' shares this is the sum of


def peaks(history: Sequence[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """The points of a (time, replicas) history, oldest first, that exceed every later one: all a `Stabilizer` reads
    of it (the largest count within a window ending now, at any later now), in a point or two under steady load."""
    out: list[tuple[float, int]] = []
    for point in reversed(history):
        if not out or point[1] > out[-1][1]:
            out.append(point)
    return tuple(reversed(out))


def encode(share: DemandShare) -> bytes:
    """Compact JSON (lists, not objects): ~60 bytes a (pool, class), ~10 a point of signal history."""
    classes = [[pool, cls, share.rates.get((pool, cls), 0.0), share.queued.get((pool, cls), 0.0),
                *share.sums.get((pool, cls), (0.0,) * N_SUMS)]
               for pool, cls in sorted({*share.rates, *share.sums, *share.queued})]
    return orjson.dumps({
        "v": WIRE_VERSION,
        "c": classes,
        "b": [[pool, role, tokens] for (pool, role), tokens in sorted(share.backlog.items())],
        "k": [[pool, *c.prefill, c.prefill_samples, *c.decode, c.decode_samples, c.kv_tokens]
              for pool, c in sorted(share.costs.items())],
        "s": [[pool, role, s.desired, round(s.since_change_s, 2), [[round(a, 2), n] for a, n in s.history]]
              for (pool, role), s in sorted(share.stable.items())],
        "t": [[pool, slope, variance] for pool, (slope, variance) in sorted(share.trends.items())],
        "l": [[pool, cls, _wire(ttft), _wire(tpot)] for (pool, cls), (ttft, tpot) in sorted(share.latency.items())],
        "q": [[pool, cls, sq] for (pool, cls), sq in sorted(share.output_sq.items())],
    })


def decode(blob: bytes) -> DemandShare:
    """The share another gateway published; ValueError when it is malformed or of another version."""
    try:
        raw = orjson.loads(blob)
        if not isinstance(raw, dict) or raw.get("v") != WIRE_VERSION:
            raise ValueError(f"unknown demand share version {raw.get('v') if isinstance(raw, dict) else None!r}")
        share = DemandShare()
        for pool, cls, rate, queued, *sums in raw["c"]:
            if len(sums) != N_SUMS:
                raise ValueError("demand share: wrong number of sums")
            key = (str(pool), str(cls))
            share.rates[key] = float(rate)
            share.queued[key] = float(queued)
            share.sums[key] = [float(v) for v in sums]
        for pool, role, tokens in raw["b"]:
            share.backlog[(str(pool), str(role))] = float(tokens)
        for pool, a, c, n_p, d0, d1, d2, n_d, kv in raw["k"]:
            share.costs[str(pool)] = CostShare((float(a), float(c)), float(n_p), (float(d0), float(d1), float(d2)),
                                               float(n_d), None if kv is None else int(kv))
        for pool, role, desired, since, history in raw["s"]:
            share.stable[(str(pool), str(role))] = StableShare(
                int(desired), float(since), tuple((float(a), int(n)) for a, n in history))
        for pool, slope, variance in raw.get("t", ()):  # absent from a gateway that publishes no trend
            share.trends[str(pool)] = (float(slope), float(variance))
        for pool, cls, ttft, tpot in raw.get("l", ()):
            share.latency[(str(pool), str(cls))] = (_maybe(ttft), _maybe(tpot))
        for pool, cls, sq in raw.get("q", ()):  # absent from a gateway that publishes no spread
            share.output_sq[(str(pool), str(cls))] = float(sq)
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed demand share: {exc}") from exc
    return share


def merge(shares: Sequence[DemandShare]) -> DemandShare:
    """The demand of all these gateways together (see the module's docstring for what adds up and what is
    averaged)."""
    out = DemandShare(gateways=sum(s.gateways for s in shares))
    for share in shares:
        for key, rate in share.rates.items():
            out.rates[key] = out.rates.get(key, 0.0) + rate
        for key, sums in share.sums.items():
            total = out.sums.setdefault(key, [0.0] * N_SUMS)
            for i, v in enumerate(sums):
                total[i] += v
        for key, n in share.queued.items():
            out.queued[key] = out.queued.get(key, 0.0) + n
        for key, sq in share.output_sq.items():
            out.output_sq[key] = out.output_sq.get(key, 0.0) + sq
        for key, tokens in share.backlog.items():
            out.backlog[key] = out.backlog.get(key, 0.0) + tokens
        for key, stable in share.stable.items():
            kept = out.stable.get(key)
            if kept is None or (stable.desired, -stable.since_change_s) > (kept.desired, -kept.since_change_s):
                out.stable[key] = stable
        for pool, (slope, variance) in share.trends.items():
            kept_trend = out.trends.get(pool, (0.0, 0.0))
            out.trends[pool] = (kept_trend[0] + slope, kept_trend[1] + variance)
        for key, (ttft, tpot) in share.latency.items():
            kept_ttft, kept_tpot = out.latency.get(key, (None, None))
            out.latency[key] = (_largest(kept_ttft, ttft), _largest(kept_tpot, tpot))
    for pool in sorted({p for s in shares for p in s.costs}):
        out.costs[pool] = merge_costs([s.costs[pool] for s in shares if pool in s.costs])
    return out


def merge_costs(costs: Sequence[CostShare]) -> CostShare:
    """Coefficients weighted by the samples behind them (capped at COST_MEMORY); the defaults' plain mean when no
    gateway has learnt anything yet; the smallest KV reported."""
    kv = [c.kv_tokens for c in costs if c.kv_tokens]
    prefill = _weighted([(c.prefill, min(c.prefill_samples, COST_MEMORY)) for c in costs])
    decode = _weighted([(c.decode, min(c.decode_samples, COST_MEMORY)) for c in costs])
    return CostShare((prefill[0], prefill[1]), sum(c.prefill_samples for c in costs),
                     (decode[0], decode[1], decode[2]), sum(c.decode_samples for c in costs), min(kv) if kv else None)


def _weighted(points: Sequence[tuple[tuple[float, ...], float]]) -> tuple[float, ...]:
    total = sum(w for _, w in points)
    if total <= 0.0:
        points, total = [(v, 1.0) for v, _ in points], float(len(points))
    width = len(points[0][0])
    return tuple(sum(v[i] * w for v, w in points) / total for i in range(width))


def _wire(value: float | None) -> float | str | None:
    """A p95 as JSON can carry it: a non-finite one as a string `float()` reads back."""
    return value if value is None or math.isfinite(value) else str(value)


def _maybe(value: float | str | None) -> float | None:
    if isinstance(value, str) and value not in ("inf", "-inf", "nan"):
        raise ValueError(f"malformed demand share: latency {value!r}")
    return None if value is None else float(value)


def _largest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
