"""The capacity signal's producer: what the gateway observes, turned into policies/capacity.py's inputs every
`capacity.interval_s`, and the answer kept for `m3gate_pool_desired_replicas{pool,role}` and GET /admin/capacity.

Inputs, per pool and traffic class, over the last `capacity.window_s`:
- arrivals: requests that finished (answered, refused for want of capacity, failed, or left by their client: demand
  all the same; not a key's quota refusal nor a client's malformed request, which more replicas would not change:
  `outcome`) plus the growth of those admitted or waiting in the gateway (GET /admin/traffic's in_flight + queued),
  so an overload whose requests have not finished yet is counted when it arrives rather than when it ends;
- the token mix from the answers' usage: prompt tokens, the cached share (prefix hits), output tokens;
- the requests waiting in the gateway's queue now (the backlog the replicas have not seen), and the uncached prompt
  tokens sent to the replicas that have not reached their first token (`Replica.prefill_tokens`: a pile-up seen
  before any of its answers).
Engine costs: the pool's prefill step cost learnt for the TTFT predictions (`Gateway.latency[pool].cost`), the
decode step cost learnt here from each stream's inter-token gaps and each non-streamed answer's time at its replica
less its prefill (`DecodeCost`, against its replica's batch: vLLM's num_requests_running at the last scrape, else
the gateway's in-flight count), the replicas' KV blocks, and their batch-slot limit (`max_num_seqs`, which vLLM does
not export: the most requests a replica ran while others waited and its KV had room, seen in SLOT_CONFIRMATIONS
scrapes).

Several gateways (`state: redis`): each tick, the gateway's own demand (`DemandShare`: the rates, token sums,
queues, prefill backlogs, learnt costs and signal memory above) is published through the shared state in one
pipeline that also reads the other live gateways' (pools/shared_state.py's `exchange_capacity`), and the pools are
sized from their merge (policies/demand_share.py): the demand one gateway would measure if it saw all the traffic, so
every gateway publishes the same figure (within a tick) and an autoscaler reads any of them. Without Redis (memory
state, or Redis unreachable) the gateway sizes for the requests it sees itself; GET /admin/capacity says which
(`demand_source`: "shared" or "local", and `demand_gateways`).

Three checks on the demand measured, the first two shared between gateways:
- the trend: each interval's arrivals (disjoint, so independent counts) give the rate's slope and its error
  (`arrival_trend`); a slope beyond two errors leads the demand by `startup_s` plus half the window (the window's
  rate is the rate at its middle);
- the latencies: the TTFT and TPOT p95 of each class's requests that finished in the last half window (a lower 99%
  confidence bound, so a slow request or two is not a risk): a stream's first token; a non-streamed answer's time
  before it was sent (the gateway's queue: its TTFT's lower bound); a refusal for want of capacity an infinite
  TTFT. Where one misses its target although the model predicts it met at the replicas serving, the demand is
  scaled until the model predicts what was measured (`risk_factor`): a target at risk raises the signal at once,
  whether the rate lags a steep rise or the model misses queueing it does not see;
- saturation, as measured: where, through the last half window, every serving replica's slots were full (vLLM
  left requests waiting, or ran its learnt slot limit) and requests were queued (vLLM's waiting plus the gateway's
  own queue), no fewer at its end than at its start, the pool role needs `saturated_floor` replicas at least
  (GET /admin/capacity: `saturated`, bottleneck `saturated`), whatever the model predicts.

The gauge has a value from the start: the replicas serving, within the pool's bounds, before the first sizing and
through the first `window_s` (a fresh gateway has seen too little to ask for fewer replicas than run; it may ask
for more), unless running gateways share their signal's memory, which it then starts from; from then on the
`Stabilizer` rules apply: rises sized on the arrival rates' lower bound (one Poisson standard deviation below the count), or on
the rates as measured where a trend beyond its noise leads them, and falls on the window's peak of the rates as
measured, so that a few requests more or fewer in a window move nothing.

`observe(record)` is the one per-request hook (a dict update; a few µs for a stream's decode and latency sample);
everything else runs on the timer.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from gateway.record import RequestRecord
from policies.capacity import (
    ClassDemand, EngineCosts, Prediction, Sizing, Stabilizer, Trend, arrival_trend, bounded, lead_factor, predict,
    rising, risk_factor, saturated_floor, scaled, size,
)
from policies.demand_share import CostShare, DemandShare, StableShare, decode, encode, merge, peaks
from policies.latency_model import DecodeCost
from pools.tasks import Periodic

log = logging.getLogger("m3gate.capacity")

DEFAULT_OUTPUT_TOKENS = 256.0  # a class whose answers have not been seen yet (an overload where none finished)
SATURATION_TICKS = 3  # ticks of full slots and queued requests before the pool is measured as saturated
SLOT_CONFIRMATIONS = 3  # scrapes running the same count while others wait before it is taken as the slot limit
SLOT_KV_ROOM = 0.9  # KV usage below which waiting requests wait for a slot rather than for KV
# unprefilled tokens sent to a replica up to which its waiting requests wait for a slot rather than for the step's
# token budget (a long prompt's chunked prefill holds the budget; vLLM's smallest default budget is 2,048 tokens)
SLOT_PREFILL_ROOM = 2048
MIN_LATENCY_SAMPLES = 10  # requests of a class in the last half window before its measured p95 is checked
_FINISHED, _ANSWERED, _PROMPT, _CACHED, _OUTPUT, _ESTIMATED, _OUTPUT_SQ = range(7)
_N_SUMS = 7  # the first N_SUMS travel in a share's sums, the output tokens' squares on their own (demand_share.py)
# refusals for want of capacity (gateway/admission.py, gateway/coordinator.py's shed): misses of the targets
CAPACITY_REFUSALS = frozenset({"queue_full", "slo_unattainable", "queue_timeout", "no_capacity"})


class CapacitySignal:
    """Replicas each pool role needs for its classes' targets, recomputed on a timer from what the gateway saw."""

    def __init__(self, gateway: Any) -> None:
        self._gw = gateway
        self.decode_costs: dict[str, DecodeCost] = {}  # per pool: the decode step learnt from inter-token gaps
        self._bucket: dict[tuple[str, str], list[float]] = {}  # this interval's sums per (pool, class)
        start = gateway.clock()
        # closed intervals: (end, sums, requests in the gateway at the end); `_start` the span's beginning
        self._closed: deque[tuple[float, dict[tuple[str, str], list[float]], dict[tuple[str, str], float]]] = deque()
        self._start: tuple[float, dict[tuple[str, str], float]] = (start, {})
        self._created = start
        # last known (prompt, cached, output) means and the output's squared variation
        self._mix: dict[tuple[str, str], tuple[float, float, float, float]] = {}
        self._slots: dict[str, list[Any]] = {}  # replica → [most running seen, scrapes it ran that full, scraped_at]
        # per (pool, role): (time, requests queued while every replica's slots were full, else 0) each tick
        self._queues: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        # per (pool, class): (finish time, TTFT, TPOT or None) of recent requests, for the check against the model
        self._latency: dict[tuple[str, str], deque[tuple[float, float, float | None]]] = {}
        self._stable: dict[tuple[str, str], Stabilizer] = {}
        self._prefilled: dict[str, deque[tuple[float, int]]] = {}  # replica → (time, its prefilled-token counter)
        self._span = float(gateway.config.capacity.window_s)  # the last window's length: for the rates' bounds
        self.entries: dict[tuple[str, str], dict[str, Any]] = {}  # (pool, role) → GET /admin/capacity's entry
        self.local: DemandShare | None = None  # this gateway's own share at the last tick
        self.source = ("local", 1)  # where the last tick's demand came from, and how many gateways it sums
        self._ticker = Periodic("m3gate-capacity", self._recompute, lambda: self._gw.config.capacity.interval_s,
                                logger=log)
        self._malformed_logged = False

    # the per-request hook ----------------------------------------------------------------------------------------
    def observe(self, record: RequestRecord) -> None:
        """One finished request: its class's demand and token mix, and its latency (see `outcome`); a complete
        answer's decode step sample."""
        pool = record.pool or record.first_pool
        kind = outcome(record)
        if not pool or kind == "excluded":
            return
        key = (pool, record.traffic_class or pool)
        sums = self._bucket.get(key)
        if sums is None:
            sums = self._bucket[key] = [0.0] * _N_SUMS
        sums[_FINISHED] += 1.0
        sums[_ESTIMATED] += record.prompt_tokens_est
        if kind == "refused":  # refused for want of capacity: a miss of every latency target
            self._sample(key, record.t_last_byte or record.t_arrival, math.inf, None)
        if kind != "answered":
            return
        prompt, completion, cached = record.tokens()
        sums[_ANSWERED] += 1.0
        sums[_PROMPT] += prompt
        sums[_CACHED] += cached
        sums[_OUTPUT] += completion
        sums[_OUTPUT_SQ] += completion * completion
        runtime = self._gw.pools.get(pool)
        replica = runtime.replicas.get(record.replica) if runtime is not None else None
        if not record.stream:
            self._answer(pool, key, record, replica, (prompt - cached, completion))
        elif (record.error is None and not record.client_disconnected and completion > 1
                and record.t_last_byte > record.t_first_byte > 0.0):
            span = record.t_last_byte - record.t_first_byte
            if replica is not None and not record.migrations:  # a resumed stream's gaps span two replicas
                self._learn_decode(pool, replica, prompt + completion / 2.0, record.t_first_byte, span,
                                   completion - 1)
            self._sample(key, record.t_last_byte, record.t_first_byte - record.t_arrival, span / (completion - 1))
        elif record.stream and record.t_first_byte > 0.0 and not record.client_disconnected:
            self._sample(key, record.t_last_byte, record.t_first_byte - record.t_arrival, None)

    def _answer(self, pool: str, key: tuple[str, str], record: RequestRecord, replica: Any,
                tokens: tuple[int, int]) -> None:
        """A non-streamed answer shows no first token: its time before it was sent (the gateway's queue) is its
        TTFT's lower bound, and its time at the replica less its prefill is decode steps, learnt where the replica
        queued nothing (its queue's wait would pass for decoding) or where its own span gives that wait."""
        uncached, completion = tokens
        sent = record.t_sent or record.t_admitted or record.t_arrival
        end = record.t_last_byte or sent
        self._sample(key, end, max(0.0, sent - record.t_arrival), None)
        if replica is None or record.migrations or record.client_disconnected or completion < 2 or end <= sent:
            return
        engine = record.engine
        queued = engine.queue_s if engine is not None else None
        if queued is None:
            load = replica.scraped
            if load is None or load.waiting > 0:
                return
            queued = 0.0
        model = self._gw.latency.get(pool)
        prefill = model.cost.a + model.cost.c * 1e-3 * uncached if model is not None else 0.0
        span = end - sent - queued - prefill
        if span > 0.0:
            self._learn_decode(pool, replica, record.tokens()[0] + completion / 2.0, sent + queued + prefill, span,
                               completion - 1)

    def _learn_decode(self, pool: str, replica: Any, context: float, start: float, span: float, steps: int) -> None:
        """One answer's decode steps (`span` seconds for `steps` tokens from `start`), against its replica's batch:
        vLLM's num_requests_running at the last scrape, else the gateway's in-flight count."""
        load = replica.scraped
        batch = load.running if load is not None and load.running > 0 else replica.in_flight + 1
        cost = self.decode_costs.get(pool)
        if cost is None:
            cost = self.decode_costs[pool] = DecodeCost()
        cost.learn(batch, context, span * self._decode_share(pool, replica, start, span) / steps)

    def _sample(self, key: tuple[str, str], at: float, ttft: float, tpot: float | None) -> None:
        samples = self._latency.get(key)
        if samples is None:
            samples = self._latency[key] = deque(maxlen=512)
        samples.append((at, ttft, tpot))

    def _decode_share(self, pool: str, replica: Any, start: float, span: float) -> float:
        """The share of a stream's time its replica spent on decode steps: the prompts other requests prefilled
        meanwhile (the replica's prefilled-token counter, sampled each interval, × the pool's learnt prefill cost)
        stretched its steps, and the model adds that stretch back from the demand (1 / (1 − ρp)); learning it
        into the decode step would count it twice."""
        marks = self._prefilled.get(replica.url)
        model = self._gw.latency.get(pool)
        if not marks or model is None or span <= 0.0:
            return 1.0
        tokens = _at(marks, start + span, replica.prefilled_tokens) - _at(marks, start, replica.prefilled_tokens)
        return max(0.1, 1.0 - model.cost.c * 1e-3 * max(0.0, tokens) / span)

    # the timer ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()

    async def _recompute(self) -> None:
        """One tick (a failure is logged by the ticker: the signal must never take the gateway down)."""
        interval = self._gw.config.capacity.interval_s
        now = self._gw.clock()
        local = self.measure(now)
        # a few intervals: a gateway late by a tick or two (a loaded event loop) still counts
        shares = await self._gw.shared.exchange_capacity(encode(local), max(3.0 * interval, 1.0))
        self.size_pools(now, local, self._peers(shares))

    def _peers(self, shares: list[tuple[str, bytes]] | None) -> list[tuple[str, DemandShare]] | None:
        """The other gateways' shares, decoded (a malformed one is skipped and logged once); None: local only."""
        if shares is None:
            return None
        own = getattr(self._gw.shared, "gateway_id", None)
        out = []
        for gateway_id, blob in shares:
            if gateway_id == own:
                continue
            try:
                out.append((gateway_id, decode(blob)))
            except ValueError as exc:
                if not self._malformed_logged:
                    self._malformed_logged = True
                    log.warning("capacity: ignoring gateway %s's demand share: %s", gateway_id, exc)
        return out

    def tick(self, now: float, peers: list[tuple[str, DemandShare]] | None = None) -> None:
        """Close this interval, measure the demand over the window, size every pool role and update its signal
        (`peers`: the other gateways' shares, as (gateway id, share); None: this gateway's demand only)."""
        self.size_pools(now, self.measure(now), peers)

    def measure(self, now: float) -> DemandShare:
        """Close this interval and return this gateway's demand over the window: its share."""
        gw = self._gw
        cfg = gw.config.capacity
        traffic = gw.traffic.view().get("pools", {})
        in_gateway = _in_gateway(traffic)
        self._closed.append((now, self._bucket, in_gateway))
        self._bucket = {}
        while len(self._closed) > 1 and self._closed[0][0] <= now - cfg.window_s:
            end, _, held = self._closed.popleft()
            self._start = (end, held)
        span = self._span = max(now - self._start[0], 1e-3)
        share = DemandShare()
        for _, sums, _ in self._closed:
            for key, values in sums.items():
                total = share.sums.setdefault(key, [0.0] * _N_SUMS)
                for i, v in enumerate(values):
                    total[i] += v
        for key, total in share.sums.items():  # the squares travel on their own (older gateways read six sums)
            share.output_sq[key] = total.pop(_OUTPUT_SQ)
        held_before = self._start[1]
        for key in {*share.sums, *in_gateway, *held_before}:
            finished = share.sums.get(key, [0.0])[_FINISHED]
            share.rates[key] = max(0.0, finished + in_gateway.get(key, 0.0) - held_before.get(key, 0.0)) / span
        for name, view in traffic.items():
            for cls, counts in view.get("classes", {}).items():
                share.queued[(name, cls)] = float(counts.get("queued", 0))
        for name, pool in gw.pools.items():
            for role in ("prefill", "decode") if pool.disaggregated else ("both",):
                replicas = pool.of_role(role) if pool.disaggregated else list(pool.replicas.values())
                share.backlog[(name, role)] = float(sum(r.prefill_tokens for r in replicas))
            cost = self._costs(name, pool, "decode" if pool.disaggregated else "both")  # KV: the decoding side's
            model, decode_cost = gw.latency.get(name), self.decode_costs.get(name)
            share.costs[name] = CostShare(
                (cost.prefill_step_s, cost.prefill_s_per_1k), float(model.cost.samples) if model is not None else 0.0,
                (cost.decode_step_s, cost.decode_s_per_seq, cost.decode_s_per_seq_1k),
                float(decode_cost.samples) if decode_cost is not None else 0.0, cost.kv_tokens)
        share.trends = self._trends(gw.pools)
        share.latency = self._latency_p95(now - cfg.window_s / 2.0)
        for key, stable in self._stable.items():
            if stable.desired is not None:
                share.stable[key] = StableShare(stable.desired, now - stable.changed_at,
                                                tuple((now - t, n) for t, n in peaks(stable.history)))
        self.local = share
        return share

    def _trends(self, pools: Any) -> dict[str, tuple[float, float]]:
        """Per pool, the slope of its arrival rate through the window's intervals (`arrival_trend`): each interval's
        arrivals are the requests that finished in it plus the growth of those held in the gateway."""
        points: dict[str, list[tuple[float, float, float]]] = {name: [] for name in pools}
        prev_t, prev_held = self._start
        for end, sums, held in self._closed:
            arrived = dict.fromkeys(points, 0.0)
            for key in {*sums, *held, *prev_held}:
                if key[0] in arrived:
                    arrived[key[0]] += sums.get(key, [0.0])[_FINISHED] + held.get(key, 0.0) - prev_held.get(key, 0.0)
            for name, n in arrived.items():
                points[name].append((prev_t, end, n))
            prev_t, prev_held = end, held
        out = {}
        for name, intervals in points.items():
            trend = arrival_trend(intervals)
            out[name] = (trend.slope, trend.variance)
        return out

    def _latency_p95(self, since: float) -> dict[tuple[str, str], tuple[float | None, float | None]]:
        """Per (pool, class), the TTFT and TPOT p95 of the requests that finished since `since` (None below
        MIN_LATENCY_SAMPLES of them)."""
        out = {}
        for key, samples in list(self._latency.items()):
            while samples and samples[0][0] < since:
                samples.popleft()
            if not samples:
                del self._latency[key]
                continue
            ttfts = [ttft for _, ttft, _ in samples]
            tpots = [tpot for _, _, tpot in samples if tpot is not None]
            out[key] = (_p95(ttfts), _p95(tpots))
        return out

    def size_pools(self, now: float, local: DemandShare, peers: list[tuple[str, DemandShare]] | None) -> None:
        """Size every pool role from `local` merged with `peers` (in gateway-id order, so that every gateway adds
        the same numbers in the same order) and update its signal."""
        gw = self._gw
        cfg = gw.config.capacity
        if peers is None:
            merged = local
            self.source = ("local", 1)
        else:
            own = str(getattr(gw.shared, "gateway_id", ""))
            merged = merge([s for _, s in sorted([*peers, (own, local)], key=lambda p: p[0])])
            self.source = ("shared", merged.gateways)
        # the first window measures: a fresh gateway (a restart, one more gateway) has seen too little to ask for
        # fewer replicas than run, so it publishes nothing until then, unless running gateways share their memory
        measuring = now - self._created < cfg.window_s
        live = set(gw.pools)
        for key in [k for k in self._stable if k[0] not in live]:
            del self._stable[key]
            self.entries.pop(key, None)
        self._mark_replicas(now, max(cfg.window_s, 60.0))
        for name, pool in list(gw.pools.items()):
            demand = self._demand(name, merged)
            # the window's rate is the rate at its middle: lead by half the window besides the start-up
            trend = Trend(*merged.trends.get(name, (0.0, 0.0)))
            factor = lead_factor(sum(d.rate for d in demand), trend, cfg.startup_s + self._span / 2.0)
            # a rise is asked for on the rates' lower bound (one Poisson standard deviation below the count): a
            # window holding a few requests more than usual is noise, not a target at risk; a trend beyond its
            # noise is not, and leads the rates as measured
            lower = self._demand(name, merged, z=1.0 if factor <= 1.0 else 0.0)
            latency = {cls: p95s for (p, cls), p95s in merged.latency.items() if p == name}
            roles = ("prefill", "decode") if pool.disaggregated else ("both",)
            for role in roles:
                self._size_role(now, name, pool, role, merged, demand, lower, (factor, rising(trend)), latency,
                                measuring)

    def _size_role(self, now: float, name: str, pool: Any, role: str, merged: DemandShare, demand: list[ClassDemand],
                   lower: list[ClassDemand], trend: tuple[float, bool],
                   latency: dict[str, tuple[float | None, float | None]], measuring: bool) -> None:
        """One pool role's sizing and signal: for the demand measured (falls) and for its lower bound led by the
        trend (rises), both scaled by the check against the latencies measured, and at least what a measured
        saturation needs; no fall while the demand rises or during the first window."""
        cfg, bounds = self._gw.config.capacity, pool.config.capacity
        factor, rises = trend
        costs = self._merged_costs(name, pool, role, merged)
        current = len(pool.of_role(role)) if pool.disaggregated else len(pool.replicas)
        backlog = merged.backlog.get((name, role), 0.0)
        # a target missed now that the model does not predict: the demand it rests on is short by this
        risk = risk_factor(role, demand, costs, current, latency, prefill_backlog=backlog) if current else 1.0
        measured = size(role, scaled(demand, risk), costs, prefill_backlog=backlog)
        led = scaled(lower, factor * risk)
        needed = size(role, led, costs, prefill_backlog=backlog)
        floor = self._saturated(now, name, pool, role, merged, demand)
        if floor > needed.replicas:  # slots full and the queue growing: short of replicas, whatever the model says
            needed = Sizing(floor, "saturated", predict(role, led, costs, floor, prefill_backlog=backlog))
        if floor > measured.replicas:
            measured = Sizing(floor, "saturated", needed.prediction)
        stable = self._stable.get((name, role))
        if stable is None and (name, role) in merged.stable:
            stable = self._stable[(name, role)] = _seeded(now, merged.stable[(name, role)], cfg)
        if stable is None:  # it starts from the replicas running: falling below them waits for the window
            stable = self._stable[(name, role)] = Stabilizer(
                cfg.scale_down_stabilization_s, bounded(current, bounds.min_replicas, bounds.max_replicas), now)
        stable.window_s = cfg.scale_down_stabilization_s
        desired = stable.update(now, needed.replicas, measured.replicas, bounds.min_replicas, bounds.max_replicas,
                                hold=rises or measuring)
        peers = merged.stable.get((name, role)) if merged.gateways > 1 else None
        if peers is not None and peers.desired > desired:
            # gateways sharing their demand publish one figure: each stabilizer holds its own peaks through the
            # scale-down window, so the highest of them (as last shared) is what every gateway asks for
            desired = bounded(peers.desired, bounds.min_replicas, bounds.max_replicas)
        entry = _entry(name, role, current, desired, needed, measured, (factor, risk), demand, latency, costs,
                       now - stable.changed_at, backlog, predict(role, led, costs, current, prefill_backlog=backlog),
                       predict(role, led, costs, desired, prefill_backlog=backlog))
        entry["saturated"] = floor > 0
        self.entries[(name, role)] = entry

    def _saturated(self, now: float, name: str, pool: Any, role: str, merged: DemandShare,
                   demand: list[ClassDemand]) -> int:
        """The replicas a measured saturation needs (`saturated_floor`), or 0: through the last half window every
        serving replica's slots were full (vLLM left requests waiting, or runs its learnt slot limit) and requests
        were queued (vLLM's waiting and the gateway's own queue), no fewer at its end than at its start."""
        replicas = [r for r in (pool.of_role(role) if pool.disaggregated else pool.replicas.values())
                    if r.is_available(now)]
        full = bool(replicas) and all(self._full(r) for r in replicas)
        queued = sum(r.scraped.waiting for r in replicas if r.scraped is not None)
        if role != "decode":  # the gateway's queue is in front of the pool's first step
            queued += sum(merged.queued.get((name, d.name), 0.0) for d in demand)
        marks = self._queues.setdefault((name, role), deque())
        marks.append((now, queued if full else 0.0))
        since = now - self._gw.config.capacity.window_s / 2.0
        while marks and marks[0][0] < since:
            marks.popleft()
        if len(marks) < SATURATION_TICKS or not all(q > 0.0 for _, q in marks) or marks[-1][1] < marks[0][1]:
            return 0
        answered = sum(merged.sums.get((name, d.name), [0.0] * _N_SUMS)[_ANSWERED] for d in demand)
        return saturated_floor(len(replicas), sum(d.rate for d in demand), answered / self._span)

    def _full(self, replica: Any) -> bool:
        """vLLM leaves requests waiting only when it cannot run them (slots, KV or its token budget full), or it
        runs as many as its learnt slot limit."""
        load = replica.scraped
        if load is None:
            return False
        slots = self._slot_limit(replica.url)
        return load.waiting > 0 or (slots is not None and load.running >= slots)

    def _slot_limit(self, url: str) -> int | None:
        seen = self._slots.get(url)
        return int(seen[0]) if seen is not None and seen[1] >= SLOT_CONFIRMATIONS else None

    def _mark_replicas(self, now: float, keep_s: float) -> None:
        """Per replica: its prefilled-token counter (for `_decode_share`), and its batch-slot limit, which vLLM
        does not export: the most requests it ran while others waited and neither its KV nor its token budget was
        short, seen in SLOT_CONFIRMATIONS scrapes (a count it runs beyond is a new lower bound)."""
        live = set()
        for pool in self._gw.pools.values():
            for replica in pool.replicas.values():
                live.add(replica.url)
                marks = self._prefilled.setdefault(replica.url, deque())
                marks.append((now, replica.prefilled_tokens))
                while marks and marks[0][0] < now - keep_s:
                    marks.popleft()
                load, at = replica.scraped, replica.scraped_at
                seen = self._slots.get(replica.url)
                if load is None or load.running <= 0 or (seen is not None and seen[2] == at):
                    continue
                if seen is None or load.running > seen[0]:
                    seen = self._slots[replica.url] = [load.running, 0, at]
                seen[2] = at
                if (load.waiting > 0 and load.running == seen[0] and load.kv_usage < SLOT_KV_ROOM
                        and replica.prefill_tokens <= SLOT_PREFILL_ROOM):
                    seen[1] += 1
        for table in (self._prefilled, self._slots):
            for url in [u for u in table if u not in live]:
                del table[url]

    def _demand(self, pool: str, share: DemandShare, z: float = 0.0) -> list[ClassDemand]:
        """Each class's demand on `pool` over the window; with `z` > 0 its arrival rate `z` Poisson standard
        deviations below the count (a lower bound)."""
        classes = self._gw.config.traffic.classes
        keys = {k for k in (*share.rates, *share.sums, *share.queued) if k[0] == pool}
        out = []
        for key in sorted(keys):
            sums = share.sums.get(key, [0.0] * _N_SUMS)
            if sums[_ANSWERED] > 0:
                n = sums[_ANSWERED]
                mean = sums[_OUTPUT] / n
                # older gateways publish no squares: their answers' spread is unknown, taken as exponential
                spread = share.output_sq[key] / n / (mean * mean) - 1.0 if key in share.output_sq and mean > 0 else 1.0
                mix = self._mix[key] = (sums[_PROMPT] / n, sums[_CACHED] / n, mean, max(0.0, spread))
            else:
                mix = self._mix.get(key) or (
                    sums[_ESTIMATED] / sums[_FINISHED] if sums[_FINISHED] else 0.0, 0.0, DEFAULT_OUTPUT_TOKENS, 1.0)
            prompt, cached, output, spread = mix
            cfg = classes.get(key[1])
            targets = cfg.latency_targets() if cfg is not None else {}
            ttft = dict(targets.get("ttft", ())).get("p95")
            tpot = dict(targets.get("tpot", ())).get("p95")
            out.append(ClassDemand(
                key[1], _lower(share.rates.get(key, 0.0), self._span, z), prompt, max(0.0, prompt - cached), output,
                None if ttft is None else ttft / 1000.0, None if tpot is None else tpot / 1000.0,
                share.queued.get(key, 0.0), spread))
        return out

    def _merged_costs(self, name: str, pool: Any, role: str, share: DemandShare) -> EngineCosts:
        """The engine costs merged over the gateways (policies/demand_share.py); this gateway's own without a
        share for the pool."""
        merged = share.costs.get(name)
        if merged is None:
            return self._costs(name, pool, role)
        (a, c), (d0, d1, d2) = merged.prefill, merged.decode
        return EngineCosts(prefill_step_s=a, prefill_s_per_1k=c, decode_step_s=d0, decode_s_per_seq=d1,
                           decode_s_per_seq_1k=d2, kv_tokens=merged.kv_tokens,  # the decoding side's: what needs KV
                           max_num_seqs=self._role_slots(pool, role))

    def _role_slots(self, pool: Any, role: str) -> int | None:
        """The role's batch-slot limit: the pool's `max_num_seqs` when configured, else the smallest learnt of its
        replicas' (they are launched alike); None while none has been seen full."""
        if pool.config.max_num_seqs:
            return pool.config.max_num_seqs
        replicas = pool.of_role(role) if pool.disaggregated else list(pool.replicas.values())
        known = [n for n in (self._slot_limit(r.url) for r in replicas) if n is not None]
        return min(known) if known else None

    def _costs(self, name: str, pool: Any, role: str) -> EngineCosts:
        model = self._gw.latency.get(name)
        decode = self.decode_costs.get(name) or DecodeCost()
        replicas = pool.of_role(role) if pool.disaggregated else list(pool.replicas.values())
        kv = [r.kv_blocks * r.block_size for r in replicas if r.kv_blocks]
        d0, d1, d2 = decode.coef
        return EngineCosts(
            prefill_step_s=model.cost.a if model is not None else 0.02,
            prefill_s_per_1k=model.cost.c if model is not None else 0.06,
            decode_step_s=d0, decode_s_per_seq=d1, decode_s_per_seq_1k=d2, kv_tokens=min(kv) if kv else None,
            max_num_seqs=self._role_slots(pool, role))

    # what is read ------------------------------------------------------------------------------------------------
    def desired(self) -> dict[tuple[str, str], int]:
        """(pool, role) → the replicas asked for (m3gate_pool_desired_replicas), for every pool role from the start:
        before its first sizing, the replicas serving within the pool's bounds (an autoscaler reading an absent
        series errors or holds)."""
        out = {}
        for name, pool in self._gw.pools.items():
            bounds = pool.config.capacity
            for role in ("prefill", "decode") if pool.disaggregated else ("both",):
                entry = self.entries.get((name, role))
                if entry is not None and entry["desired"] is not None:
                    out[(name, role)] = entry["desired"]
                else:
                    current = len(pool.of_role(role)) if pool.disaggregated else len(pool.replicas)
                    out[(name, role)] = bounded(current, bounds.min_replicas, bounds.max_replicas)
        return out

    def view(self) -> dict[str, Any]:
        """GET /admin/capacity: per pool and role, the counts, the bottleneck, the predictions and the demand."""
        cfg = self._gw.config.capacity
        pools: dict[str, Any] = {}
        for (pool, role), entry in sorted(self.entries.items()):
            pools.setdefault(pool, {})[role] = entry
        local: dict[str, Any] = {}
        if self.local is not None:
            for (pool, cls), rate in sorted(self.local.rates.items()):
                local.setdefault(pool, {})[cls] = {"rate_per_s": round(rate, 4)}
        source, gateways = self.source
        return {"interval_s": cfg.interval_s, "window_s": cfg.window_s,
                "scale_down_stabilization_s": cfg.scale_down_stabilization_s, "startup_s": cfg.startup_s,
                # "shared": the demand below is the sum over `demand_gateways` live gateways (state: redis);
                # "local": this gateway's alone (memory state, or Redis unreachable)
                "demand_source": source, "demand_gateways": gateways,
                "local_demand": local,  # this gateway's own share of the demand, per pool and class
                "pools": pools}


def outcome(record: RequestRecord) -> str:
    """What a finished request says of the pool's capacity:
    - "answered": a 200 with its usage (demand, token mix, latency);
    - "refused": refused for want of capacity (`CAPACITY_REFUSALS`: the queue full, the SLO unattainable, a
      wait for a slot that ran out, no slot and no queue): demand, and a miss of every latency target;
    - "excluded": any other 4xx but 499 (a key over its quota, `rate_limit_exceeded`, or a malformed, unauthorised,
      too large request): the client's doing, neither demand nor latency — more replicas change nothing;
    - "demand": everything else, an arrival without a latency sample: a client gone (499; it held a slot or a queue
      place), a 200 without usage, and every 5xx — a replica's failure or a gateway with no healthy replica is a
      fault that ejection, draining and the autoscaler's own health checks answer, not a shortage of replicas;
      counted as a miss it would scale out a pool that meets its targets whenever one replica breaks."""
    status = record.status
    if status == 200:
        return "answered" if record.usage else "demand"
    if record.error in CAPACITY_REFUSALS:
        return "refused"
    if 400 <= status < 500 and status != 499:
        return "excluded"
    return "demand"


def _in_gateway(traffic: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Requests admitted (in flight) or waiting in the gateway now, per (pool, class), from GET /admin/traffic's
    view."""
    out: dict[tuple[str, str], float] = {}
    for pool, view in traffic.items():
        for cls, counts in view.get("classes", {}).items():
            out[(pool, cls)] = float(counts.get("in_flight", 0) + counts.get("queued", 0))
    return out


def _seeded(now: float, shared: StableShare, cfg: Any) -> Stabilizer:
    """A signal that starts where the running gateways' is (a gateway joining them, or restarted): same count, same
    time since its last change, same recent needs, so that it falls when theirs does."""
    stable = Stabilizer(window_s=cfg.scale_down_stabilization_s, desired=shared.desired,
                        changed_at=now - shared.since_change_s)
    stable.history.extend(sorted((now - age, n) for age, n in shared.history))
    return stable


def _at(marks: deque[tuple[float, int]], t: float, now_value: int) -> float:
    """A counter's value at time t, linear between its samples (its current value after the last one). The samples
    are in time order and t is mostly recent: read from the newest."""
    after: tuple[float, int] | None = None
    for when, value in reversed(marks):
        if when < t:
            if after is None:
                return float(now_value)
            if after[0] <= when:
                return float(after[1])
            return float(value) + (after[1] - float(value)) * (t - when) / (after[0] - when)
        after = (when, value)
    return float(now_value) if after is None else float(after[1])


def _lower(rate: float, span: float, z: float) -> float:
    """An arrival rate `z` Poisson standard deviations below the count it was measured from over `span` seconds."""
    if z <= 0.0:
        return rate
    arrived = rate * span
    return max(0.0, arrived - z * math.sqrt(arrived)) / span


def _p95(values: list[float], confidence: float = 0.99) -> float | None:
    """A lower confidence bound of the values' 95th percentile: the largest order statistic the p95 is at least with
    probability `confidence` (binomial), so a slow request or two among a dozen is not a target at risk (the plain
    sample p95 of 12 values is their maximum); None below MIN_LATENCY_SAMPLES values."""
    n = len(values)
    if n < MIN_LATENCY_SAMPLES:
        return None
    ordered = sorted(values)
    # P(at least r of n values lie below the p95) for r = n, n − 1, ...: the largest r with it ≥ confidence
    at_least, rank = 0.0, 0
    for r in range(n, 0, -1):
        at_least += math.comb(n, r) * 0.95 ** r * 0.05 ** (n - r)
        if at_least >= confidence:
            rank = r
            break
    return ordered[rank - 1] if rank else None


def _seconds(value: float) -> float | None:
    """JSON has no infinity: a count that cannot keep up predicts null."""
    return round(value, 4) if math.isfinite(value) else None


def _seconds_or_none(value: float | None) -> float | None:
    return None if value is None else _seconds(value)


def _prediction(p: Prediction) -> dict[str, Any]:
    return {"replicas": p.replicas,
            "classes": {name: {"ttft_p95_s": _seconds(c.ttft_p95_s), "tpot_p95_s": _seconds(c.tpot_p95_s)}
                        for name, c in p.classes.items()},
            "utilisation": _seconds(p.utilisation),
            "kv_usage": None if p.kv_usage is None else _seconds(p.kv_usage),
            "meets_targets": p.ok()}


def _entry(pool: str, role: str, current: int, desired: int | None, needed: Sizing, measured: Sizing,
           factors: tuple[float, float], demand: list[ClassDemand],
           latency: dict[str, tuple[float | None, float | None]], costs: EngineCosts, since_change_s: float | None,
           backlog: float, at_current: Prediction, at_desired: Prediction | None) -> dict[str, Any]:
    lead, risk = factors
    return {
        "pool": pool, "role": role, "current": current, "desired": desired,
        "needed": needed.replicas,  # for the demand expected once a new replica is ready (lead, lower bound)
        "needed_now": measured.replicas,  # for the demand measured now
        "bottleneck": needed.bottleneck,
        "since_change_s": None if since_change_s is None else round(since_change_s, 1),  # seconds since the signal last changed
        "lead_factor": round(lead, 3),  # the demand's trend a start-up ahead
        "risk_factor": round(risk, 3),  # demand × this reproduces the latencies measured (1: the model holds)
        "prefill_backlog_tokens": backlog,  # uncached tokens sent to the replicas, not yet at their first token
        "predicted": {"current": _prediction(at_current),
                      "desired": None if at_desired is None else _prediction(at_desired)},
        "demand": {d.name: {"rate_per_s": round(d.rate, 4), "prompt_tokens": round(d.prompt_tokens, 1),
                            "uncached_tokens": round(d.uncached_tokens, 1), "output_tokens": round(d.output_tokens, 1),
                            "queued": d.queued, "output_cv2": round(d.output_cv2, 3),  # the answers' spread
                            "ttft_p95_target_s": d.ttft_p95_s, "tpot_p95_target_s": d.tpot_p95_s,
                            "measured_ttft_p95_s": _seconds_or_none(latency.get(d.name, (None, None))[0]),
                            "measured_tpot_p95_s": _seconds_or_none(latency.get(d.name, (None, None))[1])}
                   for d in demand},
        "costs": {"prefill_step_s": round(costs.prefill_step_s, 5), "prefill_s_per_1k": round(costs.prefill_s_per_1k, 5),
                  "decode_step_s": round(costs.decode_step_s, 5), "decode_s_per_seq": round(costs.decode_s_per_seq, 7),
                  "decode_s_per_seq_1k": round(costs.decode_s_per_seq_1k, 7), "kv_tokens": costs.kv_tokens,
                  "max_num_seqs": costs.max_num_seqs},  # the batch-slot limit learnt (vLLM does not export it)
    }
