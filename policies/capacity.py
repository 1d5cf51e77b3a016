"""How many replicas a pool (or one role of a disaggregated pool) needs so that its classes meet their TTFT and TPOT
p95 targets at a given demand, queueing included; and how that number is turned into a signal an autoscaler can
follow without flapping.

The model, per replica at N replicas (arrivals spread evenly, as the replica policy spreads them):

- Decode. A step of `B` sequences takes `d0 + g · B` seconds (`DecodeCost`, g the per-sequence cost at the mean
  context). Little's law gives `B = Λo · TPOT` (Λo: output tokens per second per replica), and prefill work sharing
  the step (an aggregated replica with chunked prefill) stretches it by 1/(1 − ρp), ρp the share of the GPU the
  prefill tokens take. So TPOT = d0 / (1 − ρp − g · Λo): the utilisation law, with a pole where the replica is
  full. TPOT p95 is the step at the 95th percentile of the batch (Poisson: B + 1.645 √B), or, where larger, a
  class's decode steps plus the prefills that stall it at their 95th percentile (compound Poisson over the time
  it decodes): a 32-token answer that meets one 4,000-token prefill is slowed by its whole length.
- Prefill. An M/G/1 queue per replica: a request's service is `a + c · uncached / (1 − ρd)` (the learnt step cost
  `PrefillCost`, slowed by the share ρd = g · Λo the decode batch takes on an aggregated replica), the mean wait by
  Pollaczek–Khinchine, its tail by the usual exponential approximation (P(wait > t) ≈ ρ · e^(−t ρ / E[W])). TTFT
  p95 of a class = wait p95 + its own service. A load-aware router does better than N queues of random shares
  (an M/G/N pool is the other bound), one that keeps prefixes where they are cached worse: bench_autoscale measured
  the TTFT p95 1.4–2.8× below this model on a calm machine and up to 2.5× above it on a loaded one, where an
  M/G/N version erred lower still (docs/performance.md).
  The engine batches several prefills into one step, so this errs high when many short prompts arrive together.
- KV memory. Contexts in flight per replica (B decoding, plus the ones prefilling) × their mean tokens (prompt +
  half the output) against `kv_limit` of the replica's blocks × block size. The prefix cache is not counted as
  shared (conservative: shared prefixes hold one copy).
- Batch slots. A replica runs at most `max_num_seqs` sequences (vLLM's --max-num-seqs; the gateway learns it, as
  vLLM does not export it): a request holds a slot from its prefill to its last token, so the slots are a G/G/c
  queue whose occupancy is λ · (prefill + output × TPOT) (Little's law). Full (occupancy ≥ slots): the waiting
  queue grows without bound, whatever the compute model says; below, the wait for a slot (Erlang C, its tail
  scaled by the answers' spread) adds to the TTFT, and the batch at its 95th percentile is at most the slots.
- The gateway's queue. Requests already waiting there are work that has arrived: they are added to the demand as a
  rate that clears them within `backlog_clear_s`; so are the uncached tokens sent to the replicas and not yet
  prefilled (`prefill_backlog`) beyond what the measured rates hold in prefill anyway (Little's law), which show
  a pile-up before any of its answers has come back.

`size` returns the smallest N that meets every target and the bottleneck that set it: `prefill_compute` (TTFT),
`decode_compute` (TPOT, or the utilisation cap for a class without a TPOT target), `kv_memory`, `batch_slots` (the
TTFT with the wait for a slot), or `gateway_queue` (only the backlog made the difference). Roles: `both`
(aggregated) meets all four; `prefill` TTFT; `decode` TPOT and KV; every role its slots.

`saturated_floor` grounds the signal in measurement: a pool role whose replicas' slots are full and whose queue
(vLLM's waiting or the gateway's) grows needs one more replica at least, and as many as carry the arrival rate at
the rate the running ones complete requests (the gateway reports it as the bottleneck `saturated`), whatever the
model predicts: its costs may be unlearnt (non-streamed answers show no decode gaps) or wrong.

`Stabilizer` is the signal's memory: up at once, down only `scale_down_stabilization_s` after the last change and to
the most replicas the measured demand needed over that window (so N−1 is only asked for when N−1 met the targets at
the window's peak), by more than 10% of the count and not while the demand rises, within the pool's bounds. `lead_factor` extrapolates a rising demand `startup_s` ahead (a slope
beyond two standard errors of its noise, `arrival_trend`, so that noise under constant load is not a trend).
`risk_factor` checks the model against the latencies measured: a target missed at the serving count that the model
does not predict scales the demand until it does, so a target at risk raises the signal at once.

Pure: no clock, no I/O; the gateway (gateway/capacity/signal.py) and `m3gate plan` feed it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

BOTTLENECKS = ("prefill_compute", "decode_compute", "kv_memory", "batch_slots", "gateway_queue", "saturated")
ROLES = ("both", "prefill", "decode")
_CONSTRAINTS = {"both": ("prefill_compute", "decode_compute", "kv_memory", "batch_slots"),
                "prefill": ("prefill_compute", "batch_slots"), "decode": ("decode_compute", "kv_memory", "batch_slots")}
_Z95 = 1.645
_TAIL = 0.05


@dataclass(frozen=True, slots=True)
class ClassDemand:
    """One traffic class's demand on a pool and its targets (seconds; None: no target)."""

    name: str
    rate: float  # requests arriving per second (the whole pool)
    prompt_tokens: float  # mean prompt tokens
    uncached_tokens: float  # mean prompt tokens not served from the prefix cache
    output_tokens: float  # mean output tokens
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    queued: float = 0.0  # requests of the class waiting in the gateway's queue now
    output_cv2: float = 1.0  # squared coefficient of variation of its output tokens (1: exponential, 0: all equal)


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """A pool's engine as learnt online (policies/latency_model.py): the prefill step `a + c · tokens` (c per 1K
    tokens), the decode step `d0 + d1 · batch + d2 · batch · context/1K`, and each replica's KV capacity."""

    prefill_step_s: float = 0.02
    prefill_s_per_1k: float = 0.06
    decode_step_s: float = 0.02
    decode_s_per_seq: float = 2e-4
    decode_s_per_seq_1k: float = 2e-5
    kv_tokens: int | None = None  # KV blocks × block size per replica; None: unknown, not a constraint
    max_num_seqs: int | None = None  # sequences a replica runs at once (vLLM --max-num-seqs); None: unknown


@dataclass(frozen=True, slots=True)
class ClassPrediction:
    ttft_p95_s: float  # inf where the replicas cannot keep up
    tpot_p95_s: float


@dataclass(frozen=True, slots=True)
class Prediction:
    """What N replicas of a role would give at a demand."""

    replicas: int
    classes: dict[str, ClassPrediction]
    utilisation: float  # the busiest resource's share: the prefill queue's ρ, or ρp + ρd
    kv_usage: float | None  # share of a replica's KV the contexts in flight take
    meets: dict[str, bool]  # bottleneck → whether that constraint holds at N

    def ok(self) -> bool:
        return all(self.meets.values())


@dataclass(frozen=True, slots=True)
class Sizing:
    replicas: int
    bottleneck: str | None  # None: no demand, any count meets the targets
    prediction: Prediction


@dataclass(frozen=True, slots=True)
class SizingParams:
    kv_limit: float = 0.9  # share of a replica's KV the contexts may fill before preemption looms
    max_utilisation: float = 0.9  # for classes without a target: keep the replica below this load
    backlog_clear_s: float = 10.0  # queued work (the gateway's queue, prefills not started) is demand clearing in this
    max_replicas: int = 4096  # the search's ceiling (a demand no count meets gets this)


def predict(role: str, demand: Sequence[ClassDemand], costs: EngineCosts, replicas: int,
            params: SizingParams = SizingParams(), backlog: bool = True, prefill_backlog: float = 0.0) -> Prediction:
    """Predicted p95s, utilisation and KV use of `replicas` replicas of `role` at `demand`. `prefill_backlog`:
    uncached prompt tokens already sent to the replicas and not yet prefilled (a pile-up the arrival rate does not
    show yet, e.g. a burst of a kind of prompt none of whose answers has come back), spread over
    `backlog_clear_s` like the gateway's queue."""
    n = max(replicas, 0)
    rates = [d.rate + (d.queued / params.backlog_clear_s if backlog else 0.0) for d in demand]
    total = sum(rates)
    if n == 0:
        busy = total > 0.0
        inf = math.inf if busy else 0.0
        return Prediction(0, {d.name: ClassPrediction(inf, inf) for d in demand}, inf, None,
                          {b: not busy for b in ("prefill_compute", "decode_compute", "kv_memory", "batch_slots")})
    prefill_side, decode_side = role in ("both", "prefill"), role in ("both", "decode")
    per = [r / n for r in rates]
    out_rate = sum(p * d.output_tokens for p, d in zip(per, demand))  # output tokens/s per replica
    weight = [r / total for r in rates] if total > 0 else [0.0 for _ in rates]
    context = sum(w * (d.prompt_tokens + d.output_tokens / 2.0) for w, d in zip(weight, demand))
    g = costs.decode_s_per_seq + costs.decode_s_per_seq_1k * context * 1e-3
    c = costs.prefill_s_per_1k * 1e-3
    rho_p = sum(p * d.uncached_tokens for p, d in zip(per, demand)) * c if (prefill_side and role == "both") else 0.0
    rho_d = g * out_rate if (decode_side and role == "both") else 0.0
    step = _decode(costs, g, out_rate, rho_p) if decode_side else _Decode()
    services, wait95, prefill_util = [0.0 for _ in demand], 0.0, 0.0
    if prefill_side:
        services, wait95, prefill_util = _prefill(per, demand, services, costs, c, rho_d, n, params, prefill_backlog)
    held = [(s if prefill_side else 0.0) + (d.output_tokens * step.tpot if decode_side else 0.0)
            for s, d in zip(services, demand)]
    slot_util, slot_wait95 = _slot_wait(per, held, [d.output_cv2 for d in demand], costs.max_num_seqs)
    base = [(wait95 + s) if prefill_side else (costs.decode_step_s if step.tpot < math.inf else math.inf)
            for s in services]
    classes = _classes(demand, per, services, base, slot_wait95, step, costs, g, c, rho_p, decode_side)
    kv_usage = None
    if decode_side and costs.kv_tokens:
        prefilling = sum(per) * sum(w * s for w, s in zip(weight, services)) if prefill_side else 0.0
        kv_usage = math.inf if step.batch == math.inf else (step.batch + prefilling) * context / costs.kv_tokens
    meets = _meets(demand, classes, base, (prefill_side, decode_side), (prefill_util, step.util, slot_util),
                   costs.max_num_seqs is not None, params)
    if kv_usage is not None and kv_usage > params.kv_limit:
        meets["kv_memory"] = False
    return Prediction(n, classes, max(prefill_util, step.util, slot_util), kv_usage, meets)


@dataclass(frozen=True, slots=True)
class _Decode:
    tpot: float = 0.0  # the mean decode step
    tpot95: float = 0.0
    batch: float = 0.0
    util: float = 0.0  # ρp + ρd


def _decode(costs: EngineCosts, g: float, out_rate: float, rho_p: float) -> _Decode:
    """The decode side per replica: TPOT = d0 / (1 − ρp − g · Λo), the batch by Little's law, and the step at the
    batch's 95th percentile (Poisson), which the slot limit bounds: a replica never runs more than its slots."""
    util = rho_p + g * out_rate
    if util >= 1.0:
        return _Decode(math.inf, math.inf, math.inf, util)
    tpot = costs.decode_step_s / (1.0 - util)
    batch = out_rate * tpot
    b95 = batch + _Z95 * math.sqrt(batch)
    if costs.max_num_seqs is not None:
        b95 = min(b95, float(costs.max_num_seqs))
    return _Decode(tpot, (costs.decode_step_s + g * b95) / (1.0 - rho_p), batch, util)


def _prefill(per: Sequence[float], demand: Sequence[ClassDemand], services: list[float], costs: EngineCosts,
             c: float, rho_d: float, n: int, params: SizingParams, prefill_backlog: float
             ) -> tuple[list[float], float, float]:
    """The prefill side per replica, an M/G/1 queue: each class's service, the wait's p95 and the utilisation."""
    slow = 1.0 - rho_d
    services = [costs.prefill_step_s + c * d.uncached_tokens / slow if slow > 0 else math.inf for d in demand]
    util = sum(p * s for p, s in zip(per, services))
    if prefill_backlog > 0.0 and slow > 0.0:
        excess = prefill_backlog - n * _in_prefill(per, demand, services, util)
        if excess > 0.0:
            util += excess * c / slow / (n * params.backlog_clear_s)
    lam = sum(per)
    wait95 = 0.0
    if util >= 1.0:
        wait95 = math.inf
    elif lam > 0.0 and util > 0.0:
        second = sum(p * s * s for p, s in zip(per, services)) / lam
        mean_wait = lam * second / (2.0 * (1.0 - util))
        if util > _TAIL and mean_wait > 0.0:
            wait95 = mean_wait / util * math.log(util / _TAIL)
    return services, wait95, util


def _slot_wait(per: Sequence[float], held: Sequence[float], cv2: Sequence[float], slots: int | None
               ) -> tuple[float, float]:
    """(share of a replica's batch slots taken, p95 of the wait for a free one). A request holds a slot from its
    prefill to its last token (`held` seconds a class, by its output tokens' squared variation `cv2`), so the slots
    are a G/G/c queue of occupancy λ · E[held] sequences on average (Little's law): Erlang C gives the chance to
    wait, its exponential tail the p95, scaled by (1 + cs²) / 2 for the holding times' variation (Allen–Cunneen:
    equal answers wait half as long as exponential ones). Full (occupancy ≥ slots): the queue grows without
    bound, whatever the compute model says."""
    lam = sum(per)
    if slots is None or slots <= 0 or lam <= 0.0:
        return 0.0, 0.0
    occupancy = sum(p * h for p, h in zip(per, held))
    if not occupancy < slots:
        return max(1.0, occupancy / slots), math.inf
    blocked = 1.0  # Erlang B by its recursion, then C
    for k in range(1, slots + 1):
        blocked = occupancy * blocked / (k + occupancy * blocked)
    util = occupancy / slots
    waits = blocked / (1.0 - util * (1.0 - blocked))
    mean = occupancy / lam
    if waits <= _TAIL or mean <= 0.0:
        return util, 0.0
    second = sum(p * h * h * (1.0 + max(0.0, v)) for p, h, v in zip(per, held, cv2)) / lam
    variation = max(0.0, second / (mean * mean) - 1.0)
    return util, (1.0 + variation) / 2.0 * mean / (slots - occupancy) * math.log(waits / _TAIL)


def _classes(demand: Sequence[ClassDemand], per: Sequence[float], services: Sequence[float], base: Sequence[float],
             slot_wait95: float, step: _Decode, costs: EngineCosts, g: float, c: float, rho_p: float,
             decode_side: bool) -> dict[str, ClassPrediction]:
    """Each class's TTFT p95 (its queue's wait and service, plus the wait for a batch slot) and TPOT p95 (the
    step at the batch's p95, or the prefills that stall a short answer where larger)."""
    prefill_m2 = c * c * sum(p * d.uncached_tokens ** 2 for p, d in zip(per, demand)) if rho_p > 0.0 else 0.0
    jumps, longer = [], 0.0
    for p, d in sorted(zip(per, demand), key=lambda x: -x[1].uncached_tokens):
        longer += p
        jumps.append((c * d.uncached_tokens, longer))
    classes = {}
    for d, s, ttft in zip(demand, services, base):
        own = step.tpot95
        if rho_p > 0.0 and step.tpot < math.inf and d.output_tokens > 1.0:
            own = max(step.tpot95, _tpot95_tail(costs.decode_step_s + g * step.batch, step.tpot, rho_p, prefill_m2,
                                                d.output_tokens, jumps))
        classes[d.name] = ClassPrediction(ttft + slot_wait95, own if decode_side else 0.0)
    return classes


def _meets(demand: Sequence[ClassDemand], classes: dict[str, ClassPrediction], base: Sequence[float],
           sides: tuple[bool, bool], utils: tuple[float, float, float], slots_known: bool,
           params: SizingParams) -> dict[str, bool]:
    """Which constraints hold: `prefill_compute` the TTFT targets without the wait for a slot, `batch_slots` with
    it (and slots not full), `decode_compute` the TPOT targets; classes without a target keep the load below
    `max_utilisation`."""
    prefill_side, decode_side = sides
    prefill_util, decode_util, slot_util = utils
    meets = {"prefill_compute": True, "decode_compute": True, "kv_memory": True, "batch_slots": True}
    untargeted_ttft = any(d.ttft_p95_s is None for d in demand)
    for d, ttft in zip(demand, base):
        p = classes[d.name]
        if prefill_side and d.ttft_p95_s is not None and ttft > d.ttft_p95_s:
            meets["prefill_compute"] = False
        if slots_known and d.ttft_p95_s is not None and p.ttft_p95_s > d.ttft_p95_s:
            meets["batch_slots"] = False
        if decode_side and d.tpot_p95_s is not None and p.tpot_p95_s > d.tpot_p95_s:
            meets["decode_compute"] = False
    if prefill_side and prefill_util > params.max_utilisation and untargeted_ttft:
        meets["prefill_compute"] = False
    if decode_side and decode_util > params.max_utilisation and any(d.tpot_p95_s is None for d in demand):
        meets["decode_compute"] = False
    if slot_util >= 1.0 or (slot_util > params.max_utilisation and untargeted_ttft):
        meets["batch_slots"] = False
    return meets


def saturated_floor(current: int, arrival_rate: float, completion_rate: float,
                    params: SizingParams = SizingParams()) -> int:
    """The replicas a pool role measured as saturated (its slots full, its queue growing) needs at least, whatever
    the model predicts: one more than it runs, and as many as carry the arrival rate at the rate the running ones
    complete requests, below `max_utilisation` (a saturated replica's completions are its throughput)."""
    if current <= 0:
        return 1
    if completion_rate <= 0.0:
        return current + 1
    return max(current + 1, math.ceil(current * arrival_rate / (completion_rate * params.max_utilisation) - 1e-9))


def _tpot95_tail(step: float, tpot: float, rho_p: float, prefill_m2: float, output_tokens: float,
                 jumps: Sequence[tuple[float, float]] = ()) -> float:
    """A stream's TPOT at its 95th percentile on an aggregated replica: its decode steps (`step` each) plus the
    prefills that land on the replica while it decodes, which stall it whole. Over a stream of `output_tokens` at
    the mean `tpot` (D seconds) they are compound Poisson: mean ρp · D, variance D · Σλ·s² (`prefill_m2`, per
    replica); a short answer meets a long prompt's prefill undiluted, which the mean step 1/(1 − ρp) hides.
    `jumps`: (prefill seconds, rate per replica of prefills at least that long)."""
    span = output_tokens * tpot
    stalls = rho_p * span + _Z95 * math.sqrt(span * prefill_m2)
    # rare long prefills are not normal. A chunked prefill of S seconds stalls a stream of span D by x or more when
    # it starts within D + S − x of its decoding (one that started up to S before still overlaps it), so at a rate λ
    # of such prefills the stall's p95 is x = D + S + ln(0.95) / λ, within [0, S]
    for stall, rate in jumps:
        if rate > 0.0:
            x = min(stall, max(0.0, span + stall + math.log(1.0 - _TAIL) / rate))
            stalls = max(stalls, x + rho_p * span)
    return step + stalls / (output_tokens - 1.0)


def _in_prefill(per: Sequence[float], demand: Sequence[ClassDemand], services: Sequence[float],
               util: float) -> float:
    """Uncached tokens a replica holds between arrival and first token in the steady state at this demand (Little's
    law: rate × tokens × (mean wait + service)); a backlog beyond it is a pile-up the rates do not show yet."""
    if util >= 1.0:
        return math.inf
    lam = sum(per)
    second = sum(p * s * s for p, s in zip(per, services)) / lam if lam > 0.0 else 0.0
    wait = lam * second / (2.0 * (1.0 - util))
    return sum(p * d.uncached_tokens * (wait + s) for p, d, s in zip(per, demand, services))


def _smallest(ok: Callable[[int], bool], ceiling: int) -> int:
    """The smallest n in 1..ceiling with ok(n) (ok is monotone in n), else ceiling."""
    hi = 1
    while not ok(hi):
        if hi >= ceiling:
            return ceiling
        hi = min(ceiling, hi * 2)
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def size(role: str, demand: Sequence[ClassDemand], costs: EngineCosts, params: SizingParams = SizingParams(),
         prefill_backlog: float = 0.0) -> Sizing:
    """The smallest replica count of `role` at which every class meets its targets at `demand`, and why that many
    (`prefill_backlog` as in `predict`)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if prefill_backlog <= 0.0 and not any(d.rate > 0 or d.queued > 0 for d in demand):
        return Sizing(0, None, predict(role, demand, costs, 0, params))
    ceiling = params.max_replicas
    needs = {}
    for name in _CONSTRAINTS[role]:
        needs[name] = _smallest(
            lambda n, k=name: predict(role, demand, costs, n, params, False, prefill_backlog).meets[k], ceiling)
    without_queue = max(needs.values())
    n = _smallest(lambda k: predict(role, demand, costs, k, params, True, prefill_backlog).ok(), ceiling)
    n = max(n, without_queue)
    if n > without_queue:
        bottleneck = "gateway_queue"
    else:
        bottleneck = max(needs, key=lambda k: needs[k])  # first of the order on ties
    return Sizing(n, bottleneck, predict(role, demand, costs, n, params, True, prefill_backlog))


@dataclass(frozen=True, slots=True)
class Trend:
    """How fast a demand's arrival rate is changing: its slope (requests/s per second) and that slope's variance."""

    slope: float = 0.0
    variance: float = 0.0


def arrival_trend(intervals: Iterable[tuple[float, float, float]]) -> Trend:
    """The slope of the arrival rate through a window's disjoint intervals, each (start, end, arrivals): weighted
    least squares of the interval's rate on its midpoint, weighed by its length. Disjoint intervals are independent
    counts, so the slope's variance is the Poisson one, λ / Σ δ (t − t̄)², times the counts' over-dispersion where
    they scatter more than Poisson counts (bursty traffic)."""
    points = [(0.5 * (a + b), b - a, n) for a, b, n in intervals if b > a]
    if len(points) < 3:
        return Trend()
    span = sum(d for _, d, _ in points)
    mean_t = sum(t * d for t, d, _ in points) / span
    sxx = sum(d * (t - mean_t) ** 2 for t, d, _ in points)
    if sxx <= 0.0:
        return Trend()
    arrived = sum(n for _, _, n in points)
    rate = max(arrived, 1.0) / span  # at least one arrival: an empty window's slope is not known to be exact
    slope = sum((t - mean_t) * n for t, _, n in points) / sxx
    pearson = 0.0
    for t, d, n in points:
        fitted = max(rate * 1e-3, arrived / span + slope * (t - mean_t)) * d
        pearson += (n - fitted) ** 2 / fitted
    dispersion = min(10.0, max(1.0, pearson / (len(points) - 2)))
    return Trend(slope, dispersion * rate / sxx)


def lead_factor(rate: float, trend: Trend, horizon_s: float, cap: float = 3.0, z: float = 2.0) -> float:
    """How much higher the demand will be `horizon_s` from now: 1 + slope · horizon / rate where the rate rises
    beyond `z` standard errors of its slope (noise under constant load is not a trend), else 1 (a fall waits for the
    stabilization window anyway); at most `cap`. The horizon is a new replica's start-up plus half the window the
    rate was measured over (a window's mean is the rate at its middle)."""
    if rate <= 0.0 or horizon_s <= 0.0 or trend.slope <= z * math.sqrt(max(trend.variance, 0.0)):
        return 1.0
    return min(cap, 1.0 + trend.slope * horizon_s / rate)


def rising(trend: Trend, z: float = 1.0) -> bool:
    """Whether the rate rises beyond `z` standard errors of its slope: a fall is not asked for against it (a rise
    needs two errors to lead; holding off a fall needs one, as a fall can wait)."""
    return trend.slope > z * math.sqrt(max(trend.variance, 0.0))


def scaled(demand: Sequence[ClassDemand], factor: float) -> list[ClassDemand]:
    """The same classes with their arrival rates × `factor`."""
    return [ClassDemand(d.name, d.rate * factor, d.prompt_tokens, d.uncached_tokens, d.output_tokens, d.ttft_p95_s,
                        d.tpot_p95_s, d.queued, d.output_cv2) for d in demand]


def risk_factor(role: str, demand: Sequence[ClassDemand], costs: EngineCosts, replicas: int,
                measured: dict[str, tuple[float | None, float | None]], cap: float = 4.0,
                prefill_backlog: float = 0.0) -> float:
    """The check against measured latency: where a class's measured TTFT or TPOT p95 (`measured`: class → (ttft,
    tpot), None where too few were seen) misses its target at `replicas` although the model predicts less, the
    factor by which the demand must grow for the model to predict what was measured (found by bisection, at most
    `cap`); 1 where every target is met or the model already predicts the miss. The demand measured lags a steep
    rise, and the model misses queueing it does not see: sizing for demand × this factor answers a target at risk
    at once, whatever the cause."""
    factor = 1.0
    for d in demand:
        ttft, tpot = measured.get(d.name, (None, None))
        checks = []
        if role != "decode" and ttft is not None and d.ttft_p95_s is not None and ttft > d.ttft_p95_s:
            checks.append((0, ttft))
        if role != "prefill" and tpot is not None and d.tpot_p95_s is not None and tpot > d.tpot_p95_s:
            checks.append((1, tpot))
        for which, value in checks:
            def predicted(k: float, which: int = which, name: str = d.name) -> float:
                p = predict(role, scaled(demand, k), costs, replicas, prefill_backlog=prefill_backlog).classes[name]
                return p.ttft_p95_s if which == 0 else p.tpot_p95_s

            if predicted(factor) >= value:
                continue
            if predicted(cap) < value:
                return cap
            lo, hi = factor, cap
            while hi - lo > 0.01:
                mid = 0.5 * (lo + hi)
                lo, hi = (lo, mid) if predicted(mid) >= value else (mid, hi)
            factor = hi
    return factor


def bounded(n: int, low: int, high: int | None) -> int:
    return max(low, n if high is None else min(high, n))


@dataclass
class Stabilizer:
    """One pool role's signal over time: `update(now, needed, measured)` → the replicas to ask for.

    `needed`: the count for the demand expected once a new replica would be ready (the lead included); `measured`:
    the count for the demand measured now. Up at once to `needed`; down only when `window_s` has passed since the
    last change, and only to the most `measured` asked for within the window (at least `needed`), and only by more
    than `fall_tolerance` of the count (Kubernetes' HPA ignores changes within 10 % the same way): one replica of
    ten is not worth a change, and a fall from a spike then comes in one step rather than a small one first. `hold`
    (the demand's trend is rising): no fall now."""

    window_s: float = 300.0
    desired: int | None = None
    changed_at: float = -math.inf
    history: deque[tuple[float, int]] = field(default_factory=deque)
    fall_tolerance: float = 0.1

    def update(self, now: float, needed: int, measured: int, low: int = 1, high: int | None = None,
               hold: bool = False) -> int:
        history = self.history
        history.append((now, measured))
        while history and history[0][0] < now - self.window_s:
            history.popleft()
        target = bounded(needed, low, high)
        if self.desired is None:  # the first figure: what the demand measured needs (a lower bound could be less)
            self._set(now, max(target, bounded(measured, low, high)))
        elif target > self.desired:
            self._set(now, target)
        elif now - self.changed_at >= self.window_s and not hold:  # hold: the demand is rising
            peak = bounded(max(n for _, n in history), low, high)
            lower = max(target, peak)
            if lower < self.desired * (1.0 - self.fall_tolerance):
                self._set(now, lower)
        assert self.desired is not None
        if not low <= self.desired <= (high if high is not None else self.desired):  # the bounds changed (reload)
            self._set(now, bounded(self.desired, low, high))
        return self.desired

    def _set(self, now: float, value: int) -> None:
        if value != self.desired:
            self.changed_at = now
        self.desired = value
