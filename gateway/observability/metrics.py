"""The gateway's Prometheus metrics: one `CollectorRegistry` per app, served on GET /metrics.

Two kinds of numbers, with two costs:
- per-request metrics (`RequestMetrics.observe`, ~4 µs a request), fed once per request from its `RequestRecord`,
  plus the inter-token latency histogram, fed per streamed chunk by the relay (~0.1 µs a chunk). Counters and
  histograms are plain dicts of floats keyed by label tuple (`CounterTable`, `HistogramTable`), turned into metric
  families only when Prometheus scrapes: an observation is a bisect and two list updates, where a prometheus_client
  histogram child costs ~2 µs (a lock per value, a Python loop over its buckets);
- replica and pool state (`ReplicaCollector`), read from the Gateway's `pools` only when Prometheus scrapes, so the
  hot path pays nothing for it.

Series of a pool or replica that a reload or DNS discovery removed are dropped at the next scrape (`SeriesPruner`),
so /metrics never keeps reporting replicas that are gone.

Labels stay bounded: pool, endpoint (replica URL from the config), class, thinking_mode, api, status (an HTTP code),
error type and routing reason (fixed vocabularies). Never a user, key, session or prompt.

`GET /metrics/targets` lists every configured replica in Prometheus' HTTP service-discovery format, labelled with its
pool, so the replicas' own vLLM metrics are scraped with the same pool/endpoint labels as the gateway's.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString
from prometheus_client.process_collector import ProcessCollector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.record import RequestRecord
from pools.replicas import PoolRuntime

# Latency buckets from 1 ms to 10 min. Where vLLM has a boundary (TTFT: 1 ms … 160 s; request latency: 0.3 s … 480 s)
# the same one is used, so gateway and replica histograms of one stage can be compared bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 320.0, 600.0)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # vLLM's ITL/TPOT boundaries from 10 ms up
ITL_BUCKETS = TPOT_BUCKETS  # vllm:inter_token_latency_seconds' boundaries, plus 1, 2.5 and 5 ms for batched chunks
# agent sessions: tools run from milliseconds to minutes; people think for seconds to many minutes
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
SESSION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0)
TURN_BUCKETS = (1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 55.0, 89.0, 144.0, 233.0)
# actual ÷ predicted: 1 is a perfect prediction; log-spaced both ways (a 10× miss either way is still a bucket)
RATIO_BUCKETS = (0.1, 0.2, 0.33, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

NONE = "none"  # label value for "not decided yet" (a request rejected before it had a pool or a mode)
_CODE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
ROUTING_REASONS = frozenset({
    "round_robin", "least_loaded", "session", "affinity_hit", "load_spill", "cold_rendezvous", "all_saturated",
    "retry", "pool_spill", "affinity_hit:exact", "affinity_hit:approx",  # precise pools say where a hit came from
    "overlength_retry",  # a replica refused the prompt as too long; retried in a larger pool
    "slo_move", "slo_spill", "slo_expected_miss",  # SLO-aware choice (policies/latency_model.py)
    "prefix_move",  # left its prefix's replica, persistently overloaded, for another (policies/placement.py)
    "disaggregated",  # prefilled on a prefill replica, decoded on a decode replica (gateway/disagg.py)
})


class GatewayView(Protocol):
    """What metrics read from the Gateway (kept narrow so tests can hand in a stub)."""

    pools: dict[str, PoolRuntime]
    clock: Callable[[], float]


def error_type(record: RequestRecord) -> str | None:
    """A fixed-vocabulary name for how a request failed, or None when it did not."""
    if record.client_disconnected:
        return "client_disconnected"
    error = record.error
    if error:
        if _CODE.match(error):
            return error  # RequestRejected / UpstreamFailure codes: invalid_json, model_not_found, no_healthy_replica…
        if error.startswith("upstream stream ended"):
            return "stream_incomplete"
        if error.startswith("upstream failed mid-stream"):
            return "stream_broken"
        return "other"
    if record.status >= 400:
        return f"upstream_{record.status // 100}xx"
    return None


def gateway_overhead_s(record: RequestRecord, first_send: float) -> float:
    """The gateway's own time before the first upstream attempt: body read, classification, pool and replica choice;
    time waiting in the admission queue is not overhead (it is load), nor is a failed attempt's time."""
    waited = max(0.0, record.t_admitted - record.t_routed) if record.t_admitted else 0.0
    return max(0.0, first_send - record.t_arrival - waited)


_FIRST_REASONS = frozenset({"overlength_retry", "slo_spill", "slo_expected_miss"})  # said over retry/pool_spill


def routing_reason(record: RequestRecord) -> str:
    """One reason per routed request: retry and pool spill first (what ops watch), else the replica policy's own."""
    if record.reason in _FIRST_REASONS:
        return record.reason
    if record.retried:
        return "retry"
    if (record.first_pool and record.pool != record.first_pool) or record.pool_reason.startswith("spill"):
        return "pool_spill"
    return record.reason if record.reason in ROUTING_REASONS else "other"


class BucketSeries(NamedTuple):
    """One histogram series laid open: `counts` is the series' live list (the count of each bucket, not cumulative,
    the last one +Inf, then the sum) and `bounds` its upper bounds. A value v is observed with
    `counts[bisect_left(bounds, v)] += 1.0` and `counts[-1] += v`; a hot loop may add the values' total once instead."""

    counts: list[float]
    bounds: tuple[float, ...]

    def observe(self, value: float) -> int:
        """Count one value; returns its bucket's index (where an exemplar goes)."""
        counts = self.counts
        bucket = bisect_left(self.bounds, value)
        counts[bucket] += 1.0
        counts[-1] += value
        return bucket


class HistogramTable:
    """A labelled histogram kept as plain floats and exposed at scrape time (see CounterTable for why no lock).

    Each series is one list: the count of each bucket (not cumulative, the last one +Inf) followed by the sum. An
    observation is `bisect_left` and two list updates (~0.3 µs, against ~2 µs for a prometheus_client child: a lock
    per value and a Python loop over the buckets); `observer` binds one series for a hot loop (the relay's per-chunk
    inter-token latency). The exposition is prometheus_client's own: same `le` strings, `_count`, `_sum`, and the
    exemplars OpenMetrics carries."""

    __slots__ = ("name", "documentation", "labelnames", "bounds", "series", "exemplars", "_les")

    def __init__(self, registry: CollectorRegistry | None, name: str, documentation: str,
                 labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = tuple(float(b) for b in buckets)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.series: dict[tuple[str, ...], list[float]] = {}
        self.exemplars: dict[tuple[str, ...], dict[int, tuple[dict[str, str], float]]] = {}
        if registry is not None:
            registry.register(self)

    def counts(self, key: tuple[str, ...]) -> list[float]:
        """The series' live list: bucket counts, then the sum (`list[bisect_left(bounds, v)] += 1; list[-1] += v`)."""
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [0.0] * (len(self.bounds) + 2)
        return series

    def observe(self, key: tuple[str, ...], value: float) -> None:
        self.bucket_series(key).observe(value)

    def bucket_series(self, key: tuple[str, ...]) -> BucketSeries:
        """One series, to observe into again and again without looking it up (a hot loop may also inline the
        observation: the relay's per-chunk inter-token latency)."""
        return BucketSeries(self.counts(key), self.bounds)

    def remove(self, key: tuple[str, ...]) -> None:
        self.series.pop(key, None)
        self.exemplars.pop(key, None)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = self._les
        for key, series in list(self.series.items()):
            marks = self.exemplars.get(key)
            buckets: list[Any] = []
            total = 0.0
            for i, le in enumerate(les):
                total += series[i]
                if marks and i in marks:
                    labels, value = marks[i]
                    buckets.append((le, total, Exemplar(labels, value)))  # Prometheus stamps it with the scrape
                else:
                    buckets.append((le, total))
            family.add_metric(key, buckets, series[-1])
        yield family


class CounterTable:
    """A labelled counter kept as plain floats and exposed at scrape time.

    Every per-request hook runs on the gateway's event loop, and so does the /metrics handler that reads these: one
    thread owns them, so no lock is needed, and an increment is a dict update (~0.1 µs, against ~0.7 µs for a
    prometheus_client child with its lock)."""

    __slots__ = ("name", "documentation", "labelnames", "values")

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str, labelnames: tuple[str, ...]):
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + amount

    def remove(self, key: tuple[str, ...]) -> None:
        self.values.pop(key, None)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, value in list(self.values.items()):
            family.add_metric(key, value)
        yield family


class InFlightGauge:
    """Requests started minus requests finished, per API, as plain ints read at scrape time (see CounterTable)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.started: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.since = float("-inf")  # requests that arrived before this (metrics were off) were never started here
        registry.register(self)

    def resume(self, now: float) -> None:
        """Metrics were off and are on again: requests in flight now were not all counted in; start from zero."""
        self.started = dict(self.finished)
        self.since = now

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("m3gate_requests_in_flight", "Requests the gateway is handling now.", labels=["api"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("m3gate_requests_in_flight", "Requests the gateway is handling now.",
                                   labels=["api"])
        for api, started in list(self.started.items()):
            family.add_metric([api], float(max(0, started - self.finished.get(api, 0))))
        yield family


class RequestMetrics:
    """Per-request counters and histograms, plus the few gauges other parts of the gateway set."""

    def __init__(self, gateway: GatewayView, registry: CollectorRegistry) -> None:
        self._gateway = gateway
        r = registry
        req = ("api", "pool", "class", "thinking_mode")
        cls = ("pool", "class")
        mode = ("pool", "class", "thinking_mode")

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> CounterTable:
            return CounterTable(r, name, doc, labels)

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> HistogramTable:
            return HistogramTable(r, name, doc, labels, buckets)

        self.requests = counter("m3gate_requests", "Requests answered, by outcome (status 499: the client left).",
                                (*req, "status"))
        self.errors = counter("m3gate_request_errors", "Failed requests by error type (4xx, 5xx, broken streams, "
                              "client disconnects).", ("api", "pool", "class", "type"))
        self.in_flight = InFlightGauge(r)
        self.upstream = counter("m3gate_upstream_requests", "Requests answered by each replica (final attempt).",
                                ("pool", "endpoint", "status"))
        self.e2e = histogram("m3gate_request_duration_seconds", "Arrival to last byte of every routed request.",
                             req, STAGE_BUCKETS)
        self.ttft = histogram("m3gate_time_to_first_token_seconds", "Arrival at the gateway to the first token's "
                              "event (streams).", req, TTFT_BUCKETS)
        self.tpot = histogram("m3gate_time_per_output_token_seconds", "Decode time / (output tokens - 1), per "
                              "streamed request.", mode, TPOT_BUCKETS)
        self.itl = histogram("m3gate_inter_token_latency_seconds", "Time between consecutive chunks of a stream as "
                             "the gateway relays them (one chunk is usually one token's event), per chunk.", mode,
                             ITL_BUCKETS)
        self.queue = histogram("m3gate_gateway_queue_seconds", "Time waiting in the gateway's admission queue.",
                               cls, STAGE_BUCKETS)
        self.prefill = histogram("m3gate_prefill_seconds", "Sent to the replica until its first token's event "
                                 "(replica queue + prefill + network).", cls, STAGE_BUCKETS)
        self.decode = histogram("m3gate_decode_seconds", "First to last token's event (streams).", cls, STAGE_BUCKETS)
        # vLLM's own timings of a sampled request, from its llm_request span (gateway/observability/engine_spans.py)
        self.engine_queue = histogram("m3gate_engine_queue_seconds", "Waiting in the replica's scheduler queue "
                                      "(vLLM's gen_ai.latency.time_in_queue; sampled requests of tracing replicas).",
                                      cls, STAGE_BUCKETS)
        self.engine_prefill = histogram("m3gate_engine_prefill_seconds", "Scheduled to first token inside the "
                                        "replica (vLLM's gen_ai.latency.time_in_model_prefill).", cls, STAGE_BUCKETS)
        self.engine_decode = histogram("m3gate_engine_decode_seconds", "First to last token inside the replica "
                                       "(vLLM's gen_ai.latency.time_in_model_decode).", cls, STAGE_BUCKETS)
        self.overhead = histogram("m3gate_gateway_overhead_seconds", "The gateway's own share before the upstream "
                                  "call: body read, classification, pool and replica choice (admission waits and "
                                  "retried attempts excluded).", ("api", *cls), OVERHEAD_BUCKETS)
        self.prompt_tokens = counter("m3gate_prompt_tokens", "Prompt tokens, as the replicas reported them.", cls)
        self.output_tokens = counter("m3gate_output_tokens", "Output tokens (thinking included), as reported.", cls)
        self.cached_tokens = counter("m3gate_cached_prompt_tokens", "Prompt tokens the replicas served from their "
                                     "prefix cache (usage.prompt_tokens_details.cached_tokens).", cls)
        self.estimated_tokens = counter("m3gate_prompt_tokens_estimated", "Prompt tokens as the gateway estimated "
                                        "them, for every routed request.", cls)
        self.matched_tokens = counter("m3gate_prefix_matched_tokens", "Prompt tokens the gateway's prefix index "
                                      "expected the chosen replica to have cached.", cls)
        self.routing = counter("m3gate_routing_decisions", "Routed requests by reason (affinity_hit, load_spill, "
                               "pool_spill, retry, ...).", ("pool", "reason"))
        self.ttft_prediction = histogram(
            "m3gate_ttft_prediction_ratio", "Actual ÷ predicted (calibrated median) time to first token of the chosen "
            "replica, from the upstream send, per streamed request.", ("pool",), RATIO_BUCKETS)
        self.tpot_prediction = histogram(
            "m3gate_tpot_prediction_ratio", "Actual ÷ predicted time per output token of the chosen replica, per "
            "streamed request.", ("pool",), RATIO_BUCKETS)
        self.output_prediction = histogram(
            "m3gate_output_tokens_prediction_ratio", "Actual ÷ predicted output tokens (the output-length estimate "
            "load scoring used, policies/output_estimate.py), per whole answer.", cls, RATIO_BUCKETS)
        self.ttft_p90_covered = counter(
            "m3gate_ttft_p90_covered", "Streamed requests whose TTFT (from the upstream send) was at or under the "
            "predicted P90 (covered=true) or above it (false): the calibration's coverage.", ("pool", "covered"))
        self.tool_turnaround = histogram(
            "m3gate_tool_turnaround_seconds", "Agent sessions: last byte of an answer that asked for tools → arrival "
            "of the request carrying their results (the client's tools' time).", cls, WAIT_BUCKETS)
        self.user_think = histogram(
            "m3gate_user_think_seconds", "Agent sessions: last byte of a final answer → the next user turn.", cls,
            WAIT_BUCKETS)
        self.turns = counter(
            "m3gate_turns", "Session turns by kind (first, user, tool_result), cache path (warm: at least "
            "sessions.warm_share of the prompt cached; cold; none: no usage) and how the session was found.",
            ("pool", "class", "turn_kind", "cache_path", "id_source"))
        self.turn_ttft = histogram(
            "m3gate_turn_time_to_first_token_seconds", "Arrival to first token of streamed session turns, by turn "
            "kind and cache path (warm vs cold turns).", ("pool", "class", "turn_kind", "cache_path"), TTFT_BUCKETS)
        self.turn_prompt_tokens = counter(
            "m3gate_turn_prompt_tokens", "Prompt tokens of session turns by turn index (bucketed: 1, 2, 3-4, 5-8, "
            "9-16, 17+), as the replicas reported them.", ("pool", "class", "turn"))
        self.turn_cached_tokens = counter(
            "m3gate_turn_cached_prompt_tokens", "Cached prompt tokens of session turns by turn index (bucketed): "
            "÷ m3gate_turn_prompt_tokens_total is the cached share by turn.", ("pool", "class", "turn"))
        self.session_duration = histogram(
            "m3gate_session_duration_seconds", "Ended sessions: first arrival → last byte of the last turn (task "
            "time).", ("class",), SESSION_BUCKETS)
        self.session_turns = histogram("m3gate_session_turns", "Ended sessions: their turns.", ("class",),
                                       TURN_BUCKETS)
        self.migrations = counter(
            "m3gate_stream_migrations", "Streams whose replica failed after the first byte, by outcome: resumed (on "
            "another replica; once per resumption), failed (no replica could resume it), refused (not resumable: "
            "structured output, n > 1, echo, ...; ended with the SSE error event).", ("pool", "outcome"))
        self.pauses = counter(
            "m3gate_stream_pauses", "Background streams paused for foreground requests waiting on a saturated pool "
            "(their upstream request ended, the client held, resumed exactly when the lane had room again).",
            ("pool", "class"))
        self.reloads = counter("m3gate_config_reloads", "Config reloads by result.", ("result",))
        self.reloads.values.update({("success",): 0.0, ("failure",): 0.0})  # both series exist from the start
        self.redis_up: bool | None = None  # set by the shared-state code; None: read its `available` at scrape time
        self._series: dict[tuple[str, str, str, str], _RequestSeries] = {}
        self.tables: tuple[CounterTable | HistogramTable, ...] = tuple(
            t for t in vars(self).values() if isinstance(t, (CounterTable, HistogramTable)))

    def itl_series(self, record: RequestRecord) -> BucketSeries:
        """The series the record's stream feeds with each gap between chunks (gateway/relay.py's pump)."""
        pool = record.pool or NONE
        return self.itl.bucket_series((pool, record.traffic_class or pool, record.thinking_mode or NONE))

    def engine_stages(self, pool: str, klass: str, queue: float | None, prefill: float | None,
                      decode: float | None) -> None:
        """One request's stages as its replica timed them (a joined llm_request span); None: not reported."""
        key = (pool, klass)
        for table, value in ((self.engine_queue, queue), (self.engine_prefill, prefill), (self.engine_decode, decode)):
            if value is not None:
                table.observe(key, max(0.0, value))

    def _series_of(self, req: tuple[str, str, str, str]) -> _RequestSeries:
        """The histogram series a routed request of this (api, pool, class, thinking mode) writes, made once."""
        pool, klass, mode = req[1], req[2], req[3]
        by_class, by_mode = (pool, klass), (pool, klass, mode)
        series = self._series[req] = _RequestSeries(
            self.e2e.bucket_series(req), self.ttft.bucket_series(req), self.queue.bucket_series(by_class),
            self.prefill.bucket_series(by_class), self.decode.bucket_series(by_class),
            self.tpot.bucket_series(by_mode), self.overhead.bucket_series((req[0], pool, klass)))
        return series

    def forget_series(self) -> None:
        """Series were removed from the tables (SeriesPruner): look them up afresh."""
        self._series.clear()

    def observe(self, record: RequestRecord, now: float, exemplar: dict[str, str] | None = None) -> None:
        """Feed one finished request: a few dict updates and up to seven histogram observations (~3 µs; the
        histogram series of each kind of request are looked up once, `_series_of`)."""
        api = record.api
        pool = record.pool or record.first_pool or NONE  # a 503 no_healthy_replica still belongs to its pool
        klass = record.traffic_class or pool
        mode = record.thinking_mode or NONE
        status = "499" if record.client_disconnected else str(record.status)
        if record.t_arrival >= self.in_flight.since:
            finished = self.in_flight.finished
            finished[api] = finished.get(api, 0) + 1
        req = (api, pool, klass, mode)
        self.requests.inc((*req, status))
        err = error_type(record)
        if err is not None:
            self.errors.inc((api, pool, klass, err))
        if not record.pool or not record.t_sent:
            return  # rejected before any replica was tried
        series = self._series.get(req) or self._series_of(req)
        by_class = (pool, klass)
        self.upstream.inc((pool, record.replica, status))
        self.routing.inc((pool, routing_reason(record)))
        series.e2e.observe((record.t_last_byte or now) - record.t_arrival)
        series.queue.observe(max(0.0, record.t_admitted - record.t_routed) if record.t_admitted else 0.0)
        if not record.retried:  # a retried request's t_sent is its last attempt's (a disaggregated one's: decode's)
            pd = record.pd
            series.overhead.observe(gateway_overhead_s(record, pd.first_sent if pd is not None and pd.first_sent
                                                       else record.t_sent))
        self.estimated_tokens.inc(by_class, record.prompt_tokens_est)
        if record.matched_blocks:
            runtime = self._gateway.pools.get(pool)
            block = runtime.config.block_size if runtime is not None else 128
            self.matched_tokens.inc(by_class, record.matched_blocks * block)
        usage = record.usage
        completion = 0
        if usage:
            prompt, completion, cached = record.tokens()
            self.prompt_tokens.inc(by_class, float(prompt))
            self.output_tokens.inc(by_class, float(completion))
            if cached:
                self.cached_tokens.inc(by_class, float(cached))
            if (completion and record.output_predicted and record.status == 200 and record.error is None
                    and not record.client_disconnected):
                self.output_prediction.observe(by_class, completion / record.output_predicted)
        turn = record.session
        if turn is not None:
            self._observe_turn(turn, by_class, record)
        if record.stream and record.status == 200 and record.t_first_byte and not record.client_disconnected:
            ttft = record.t_first_byte - record.t_arrival
            bucket = series.ttft.observe(ttft)
            if exemplar is not None:  # the trace id, kept as the bucket's exemplar (OpenMetrics)
                self.ttft.exemplars.setdefault(req, {})[bucket] = (exemplar, ttft)
            sent_to_first = record.t_first_byte - record.t_sent
            series.prefill.observe(sent_to_first)
            decision = record.decision
            if decision is not None and decision.predicted_ttft_s:
                self.ttft_prediction.observe((pool,), sent_to_first / decision.predicted_ttft_s)
                if decision.predicted_ttft_p90_s is not None:
                    covered = "true" if sent_to_first <= decision.predicted_ttft_p90_s else "false"
                    self.ttft_p90_covered.inc((pool, covered))
            if record.error is None and record.t_last_byte:
                decode = record.t_last_byte - record.t_first_byte
                series.decode.observe(decode)
                if completion > 1:
                    series.tpot.observe(decode / (completion - 1))
                    if decision is not None and decision.predicted_tpot_s:
                        self.tpot_prediction.observe((pool,), decode / (completion - 1) / decision.predicted_tpot_s)


    def _observe_turn(self, turn: Any, by_class: tuple[str, str], record: RequestRecord) -> None:
        """One session turn (gateway/sessions.py's SessionTurn): its kind and cache path, its wait, its TTFT."""
        t = turn.turn
        cache = turn.cache_path or NONE
        self.turns.inc((*by_class, t.kind, cache, turn.source))
        usage = record.usage
        if usage and record.status == 200:
            counted = turn.counted  # the session tracker's count, when it made one (usage_counts)
            if counted is not None:
                prompt, cached = counted
            else:
                prompt, _, cached = record.tokens()
            index = (*by_class, _turn_bucket(t.index))
            self.turn_prompt_tokens.inc(index, float(prompt))
            self.turn_cached_tokens.inc(index, float(cached))
        if t.wait_kind == "tool":
            self.tool_turnaround.observe(by_class, t.wait_s)
        elif t.wait_kind == "think":
            self.user_think.observe(by_class, t.wait_s)
        if record.stream and record.status == 200 and record.t_first_byte and not record.client_disconnected:
            self.turn_ttft.observe((*by_class, t.kind, cache), record.t_first_byte - record.t_arrival)

    def session_ended(self, session: Any) -> None:
        """A session ended (final, idle, evicted): its task time and turns, by the class of its latest turn."""
        cls = (session.traffic_class or NONE,)
        self.session_duration.observe(cls, max(0.0, session.last_end - session.started))
        self.session_turns.observe(cls, float(session.turns))


def _turn_bucket(index: int) -> str:
    """A turn index as a bounded label value."""
    if index <= 2:
        return str(max(1, index))
    for top, label in ((4, "3-4"), (8, "5-8"), (16, "9-16")):
        if index <= top:
            return label
    return "17+"


class _RequestSeries(NamedTuple):
    """The histogram series one kind of routed request writes, looked up once (`RequestMetrics._series_of`)."""

    e2e: BucketSeries
    ttft: BucketSeries
    queue: BucketSeries
    prefill: BucketSeries
    decode: BucketSeries
    tpot: BucketSeries
    overhead: BucketSeries


class SeriesPruner:
    """Drops the per-request series of pools and replicas that are gone (a reload removed them, DNS discovery lost
    them) from the tables, at each scrape, before they are collected. Registered first, so it runs first.

    Series of the "none" pool (requests rejected before a pool was chosen) stay. A request still in flight on a
    removed replica when it is pruned brings its series back once, until the next scrape."""

    def __init__(self, gateway: GatewayView) -> None:
        self._gateway = gateway
        self.tables: tuple[CounterTable | HistogramTable, ...] = ()
        self.on_removed: Callable[[], None] = lambda: None  # told when series went, so that no one keeps writing them

    def prune(self) -> int:
        """Removes the stale series now; returns how many."""
        live = {name: pool.replicas for name, pool in list(self._gateway.pools.items())}
        removed = 0
        for table in self.tables:
            names = table.labelnames
            if "pool" not in names:
                continue
            at_pool, at_endpoint = names.index("pool"), names.index("endpoint") if "endpoint" in names else -1
            keys = table.series if isinstance(table, HistogramTable) else table.values
            for key in list(keys):
                pool = key[at_pool]
                if pool == NONE:
                    continue
                replicas = live.get(pool)
                if replicas is None or (at_endpoint >= 0 and key[at_endpoint] not in replicas):
                    table.remove(key)
                    removed += 1
        if removed:
            self.on_removed()
        return removed

    def collect(self) -> Iterator[Metric]:  # no describe(): the registry then expects no names from it
        self.prune()
        return iter(())


class ReplicaCollector:
    """Replica and pool state re-exported at scrape time from what the monitor already knows."""

    def __init__(self, gateway: Any, metrics: RequestMetrics) -> None:
        self._gateway = gateway
        self._metrics = metrics
        try:
            self._version = metadata.version("m3gate")
        except metadata.PackageNotFoundError:
            self._version = "unknown"

    def collect(self) -> Iterator[Metric]:
        gw = self._gateway
        now = gw.clock()
        pe = ["pool", "endpoint"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=pe)

        healthy = gauge("m3gate_replica_healthy", "1 when the replica's /health answered 200 at the last check.")
        available = gauge("m3gate_replica_available", "1 when the replica takes requests: healthy, not draining, "
                          "not ejected after failures.")
        ejections = CounterMetricFamily("m3gate_replica_ejections", "Times the replica was ejected after a failure.",
                                        labels=pe)
        draining = gauge("m3gate_replica_draining", "1 while the replica takes no new requests but finishes its "
                         "streams: drained by the admin API, or shutting down (it refused a request as vLLM does "
                         "after SIGTERM, refused the connection, or /health answered 503).")
        drains = CounterMetricFamily("m3gate_replica_drains", "Times the replica was seen shutting down.", labels=pe)
        in_flight = gauge("m3gate_replica_in_flight_requests", "Requests this gateway has on the replica now.")
        waiting = gauge("m3gate_replica_waiting_requests", "vllm:num_requests_waiting at the last scrape.")
        running = gauge("m3gate_replica_running_requests", "vllm:num_requests_running at the last scrape.")
        kv = gauge("m3gate_replica_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc at the last scrape (0..1).")
        queries = CounterMetricFamily("m3gate_replica_prefix_cache_query_tokens", "vllm:prefix_cache_queries_total "
                                      "at the last scrape (tokens).", labels=pe)
        hits = CounterMetricFamily("m3gate_replica_prefix_cache_hit_tokens", "vllm:prefix_cache_hits_total at the "
                                   "last scrape (tokens).", labels=pe)
        age = gauge("m3gate_replica_metrics_age_seconds", "Seconds since the replica's /metrics was last read.")
        replicas = GaugeMetricFamily("m3gate_pool_replicas", "Replicas configured or discovered.", labels=["pool"])
        live = GaugeMetricFamily("m3gate_pool_available_replicas", "Replicas taking requests now.", labels=["pool"])
        for name, pool in list(gw.pools.items()):
            count = up = 0
            for replica in list(pool.replicas.values()):
                lv = [name, replica.url]
                ok = replica.is_available(now)
                count += 1
                up += ok
                healthy.add_metric(lv, float(replica.healthy))
                available.add_metric(lv, float(ok))
                ejections.add_metric(lv, float(replica.ejections))
                draining.add_metric(lv, float(replica.drain_state is not None))
                drains.add_metric(lv, float(replica.drains))
                in_flight.add_metric(lv, float(replica.in_flight))
                load = replica.scraped
                if load is not None:
                    waiting.add_metric(lv, load.waiting)
                    running.add_metric(lv, load.running)
                    kv.add_metric(lv, load.kv_usage)
                    queries.add_metric(lv, load.prefix_queries)
                    hits.add_metric(lv, load.prefix_hits)
                if replica.scraped_at is not None:
                    age.add_metric(lv, max(0.0, now - replica.scraped_at))
            replicas.add_metric([name], float(count))
            live.add_metric([name], float(up))
        yield from (healthy, available, ejections, draining, drains, in_flight, waiting, running, kv, queries, hits,
                    age, replicas, live)
        capacity = getattr(gw, "capacity", None)
        if capacity is not None:  # the capacity signal (gateway/capacity/signal.py): what an autoscaler follows
            desired = GaugeMetricFamily("m3gate_pool_desired_replicas", "Replicas the pool role needs for its "
                                        "classes' TTFT/TPOT p95 targets at the current demand, queueing included "
                                        "(stabilized; role: both, prefill or decode).", labels=["pool", "role"])
            for (name, role), value in sorted(capacity.desired().items()):
                desired.add_metric([name, role], float(value))
            yield desired
        yield from _background_windows(gw)
        estimates = getattr(gw, "estimates", None)
        if estimates is not None:
            ratio = GaugeMetricFamily("m3gate_token_estimate_ratio", "Prompt tokens the pool's replicas count ÷ the "
                                      "gateway's estimate (learned from answers; 1 until trusted).", labels=["pool"])
            for name, value in estimates.view().items():
                ratio.add_metric([name], value)
            yield ratio
        info = GaugeMetricFamily("m3gate_build_info", "The running m3gate version.", labels=["version"])
        info.add_metric([self._version], 1.0)
        yield info
        redis = self._redis_up()
        if redis is not None:
            yield GaugeMetricFamily("m3gate_redis_up", "1 when the shared-state Redis answers.", value=float(redis))

    def _redis_up(self) -> bool | None:
        state = getattr(getattr(self._gateway, "config", None), "state", None)
        if not state or state == "memory":
            return None  # no shared state configured: nothing to be up or down
        if self._metrics.redis_up is not None:
            return self._metrics.redis_up
        return bool(getattr(getattr(self._gateway, "shared", None), "available", False))


def _background_windows(gw: Any) -> Iterator[Metric]:
    """The background lane's window per pool and background class (gateway/admission.py), when there is one."""
    traffic = getattr(gw, "traffic", None)
    lanes = traffic.admission.lane_view() if traffic is not None else []
    if lanes:
        window = GaugeMetricFamily("m3gate_background_window", "Requests of the background class this gateway "
                                   "process lets in flight in the pool now (AIMD: one more per success, halved on a "
                                   "refusal, a saturated replica or a missed foreground target); 0 are admitted "
                                   "while the pool has no headroom.", labels=["pool", "class"])
        for pool, cls, size in lanes:
            window.add_metric([pool, cls], float(size))
        yield window


class GatewayMetrics:
    """The registry and everything in it, for one Gateway."""

    def __init__(self, gateway: Any) -> None:
        self.registry = CollectorRegistry()
        self.pruner = SeriesPruner(gateway)
        self.registry.register(self.pruner)  # first: stale series are gone before the tables are collected
        self.requests = RequestMetrics(gateway, self.registry)
        self.pruner.tables = self.requests.tables
        self.pruner.on_removed = self.requests.forget_series
        self.registry.register(ReplicaCollector(gateway, self.requests))
        self.registry.register(gateway.precise.collector())  # KV events and scorings of whichever pools are precise
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total etc. of this gateway process

    def started(self, api: str) -> None:
        started = self.requests.in_flight.started
        started[api] = started.get(api, 0) + 1

    def finished(self, record: RequestRecord, now: float, trace_id: str | None = None) -> None:
        self.requests.observe(record, now, {"trace_id": trace_id} if trace_id else None)

    def resume(self, now: float) -> None:
        """Metrics were turned back on by a reload: same registry, counters go on; in-flight restarts from zero."""
        self.requests.in_flight.resume(now)

    def config_reloaded(self, ok: bool) -> None:
        self.requests.reloads.inc(("success" if ok else "failure",))

    def set_redis_up(self, up: bool) -> None:
        self.requests.redis_up = up

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition Prometheus asked for (OpenMetrics carries trace-id exemplars; text format does not)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


# ----------------------------------------------------------------------------------------------------------------
# HTTP


async def metrics_endpoint(request: Request) -> Response:
    metrics: GatewayMetrics | None = request.app.state.gateway.telemetry.metrics
    if metrics is None:
        return Response("metrics are disabled (telemetry.metrics: false)\n", 404, media_type="text/plain")
    body, content_type = metrics.render(request.headers.get("accept"))
    return Response(body, headers={"content-type": content_type})


def scrape_targets(pools: Mapping[str, PoolRuntime]) -> list[dict[str, Any]]:
    """Prometheus http_sd groups: one per replica, labelled with its pool and endpoint URL."""
    groups = []
    for name, pool in pools.items():
        for url, replica in pool.replicas.items():
            parts = urlsplit(url)
            labels = {
                "pool": name,
                "endpoint": url,
                "__scheme__": parts.scheme or "http",
                "__metrics_path__": parts.path.rstrip("/") + "/metrics",
            }
            if replica.role != "both":  # a disaggregated pool's prefill / decode replica
                labels["role"] = replica.role
            groups.append({"targets": [parts.netloc], "labels": labels})
    return groups


async def targets_endpoint(request: Request) -> Response:
    gw = request.app.state.gateway
    if gw.telemetry.metrics is None:
        return JSONResponse([], 404)
    return JSONResponse(scrape_targets(gw.pools))


def metrics_routes() -> list[Route]:
    return [
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/metrics/targets", targets_endpoint, methods=["GET"]),
    ]

