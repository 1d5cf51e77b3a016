"""Traces and metrics for each request, built from its `RequestRecord`.

The gateway calls three hooks per request: `start` at arrival, `inject` before each upstream attempt, and `finish`
exactly once when the request is over, however it ended.

Spans are not kept open while a request runs. `start` and `inject` only choose ids (honouring an incoming W3C
`traceparent` and the sampler) and put a `traceparent` on the upstream call, so vLLM's own `llm_request` span joins
the trace under the gateway's attempt span. `finish` reads the record into a snapshot of plain values and queues it
(`SpanBatcher.defer`, ~2 µs on the event loop); the export worker builds the whole span tree from it, with explicit
start and end times taken from the record's timestamps, right before exporting it. No context is attached, no span is
live, no lock is taken: a fully sampled streamed request costs ~12 µs of CPU to trace (4 spans; ~4 µs of it on the
event loop), where the SDK's live-span API costs ~120 µs; a request that dies half-way leaves no open span behind.
Exporting is dearer than building: the SDK's OTLP protobuf encoding of those 4 spans takes ~100 µs, so sample
(docs/observability.md, "Cost"). An unsampled request only gets ids for its traceparent (flags 00).
Stages that need no bar of their own are attributes, rare ones are events. With tracing off the hooks do nothing but
the metrics.

Span tree of one request:

    SERVER  "chat MiniMaxAI/MiniMax-M3"           arrival → last byte (gen_ai.* and m3gate.* attributes, among them
      │                                          m3gate.classify_ms: body read + classification + pool choice,
      │                                          m3gate.queue_wait_ms, m3gate.gateway_overhead_ms: the gateway's share)
      │  event m3gate.admitted                   left the admission queue (when it waited ≥ 1 ms)
      │  event m3gate.retry                      an attempt failed before its first byte and was retried
      └─ CLIENT "POST /v1/chat/completions"      one per attempt; its id is the traceparent vLLM receives
           │                                     (m3gate.upstream.headers_ms: connect + send + the replica accepting)
           ├─ m3gate.prefill                     sent → first token's event (streams)
           └─ m3gate.decode                      first → last token's event (output tokens, TPOT; streams)

A disaggregated request (gateway/disagg.py) has one CLIENT span per side, `m3gate.pd.role` prefill / decode: the
prefill call (sent → its answer), then the decode call, whose first child is
`m3gate.kv_transfer` (sent → first token: the KV pull and one step) instead of `m3gate.prefill`.

A reload that changes `telemetry` swaps the trace pipeline (`Telemetry.apply_config`): requests sampled by the old one
are still exported by it, then it shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from importlib import metadata
from typing import Any

from opentelemetry import context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from gateway.observability.engine_spans import EngineSpans
from gateway.observability.metrics import (
    STAGE_BUCKETS,
    CounterTable,
    GatewayMetrics,
    HistogramTable,
    error_type,
    gateway_overhead_s,
    routing_reason,
)
from gateway.record import RequestRecord
from policies.config import TelemetryConfig, TracingConfig
from policies.disagg import PATHS

log = logging.getLogger("m3gate.telemetry")

OPERATION = {"chat": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat"}
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
UNSET = Status(StatusCode.UNSET)
_ENV_EXPORTERS = ("otlp", "console")


def _version() -> str:
    try:
        return metadata.version("m3gate")
    except metadata.PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# Configuration → exporter, sampler, provider


def tracing_enabled(cfg: TracingConfig, env: Mapping[str, str]) -> bool:
    """Config wins; unset, OTEL_TRACES_EXPORTER decides; OTEL_SDK_DISABLED=true always turns tracing off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if cfg.enabled is not None:
        return cfg.enabled
    return _env_exporter(env) is not None


def _env_exporter(env: Mapping[str, str]) -> str | None:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    return next((n for n in names if n in _ENV_EXPORTERS), None)


class DiscardingSpanExporter(SpanExporter):
    """Sends nothing: spans are built and go through the whole pipeline, then are dropped (benchmarks)."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def build_exporter(cfg: TracingConfig, env: Mapping[str, str]) -> SpanExporter:
    """The configured exporter. OTLP exporters read the remaining OTEL_EXPORTER_OTLP_* variables themselves
    (headers, timeout, compression, certificates, and the endpoint when the config names none)."""
    name = cfg.exporter or _env_exporter(env) or "otlp"
    if name == "console":
        return ConsoleSpanExporter(service_name=None)
    if name == "discard":
        return DiscardingSpanExporter()
    protocol = (cfg.protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=cfg.endpoint)
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        endpoint = cfg.endpoint
        if endpoint and endpoint.rstrip("/").count("/") <= 2:  # a bare http://host:4318: the signal path is implied
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use grpc or http/protobuf")


def build_provider(cfg: TracingConfig, env: Mapping[str, str], processor: SpanProcessor) -> TracerProvider:
    """A provider for this app only (never the global one): resource, sampler and id generator for our spans."""
    attributes: dict[str, str] = {"service.version": _version()}
    if not env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = cfg.service_name  # else Resource.create reads OTEL_SERVICE_NAME itself
    sampler = ParentBased(TraceIdRatioBased(cfg.sample_ratio)) if cfg.sample_ratio is not None else None
    provider = TracerProvider(sampler=sampler, resource=Resource.create(attributes), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider




# ----------------------------------------------------------------------------------------------------------------
# Span export: a request's spans handed over at once


class SpanBatcher(SpanProcessor):
    """The SDK's BatchSpanProcessor, fed whole requests as plain-value snapshots (`defer`: one deque.append on the
    event loop, no lock). The worker thread turns them into spans (`build`) right before exporting them.

    Why snapshots: spans waiting for their batch are a dozen garbage-collected objects per request, which the
    collector walks at every pass and promotes, until full collections of the whole heap come round again and again
    (~6 µs a request at full sampling). A snapshot is a tuple of numbers, strings, tuples of those and an attribute
    dict of those: the collector stops tracking it at its first pass, and the spans, built just before their export,
    die young.

    The worker wakes every OTEL_BSP_SCHEDULE_DELAY ms (default 5000), or as soon as about
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans (512) are waiting, and exports batches of at most that many spans. About
    OTEL_BSP_MAX_QUEUE_SIZE spans (2048) may wait; beyond, the oldest requests are dropped. Shutdown exports what is
    left, then shuts the exporter down."""

    SPANS_PER_REQUEST = 4  # a streamed request's; queue sizes in spans are converted with it

    def __init__(self, exporter: SpanExporter, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.exporter = exporter
        self.build: Callable[[Any], list[ReadableSpan]] = _no_spans  # set by the Tracing that owns it
        per = self.SPANS_PER_REQUEST
        self._batch = max(1, _env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
        self._max_queue = max(1, _env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048) // per)
        self._wake_at = max(1, min(self._batch // per, self._max_queue))
        self._delay_s = max(0.0, _env_int(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000)
        self._queue: deque[Any] = deque(maxlen=self._max_queue)  # snapshots, or ready spans (`on_end`)
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._closed = False
        self.dropped = 0  # requests dropped because the queue was full
        self._thread = threading.Thread(target=self._work, name="m3gate-span-export", daemon=True)
        self._thread.start()

    def defer(self, snapshot: tuple[Any, ...]) -> None:
        """Queue one request's snapshot (event loop thread)."""
        if self._closed:
            return
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1
            if self.dropped == 1:  # once; then see `dropped`
                log.warning("span export queue full (%d requests): dropping the oldest", self._max_queue)
        queue.append(snapshot)
        if len(queue) >= self._wake_at and not self._wake.is_set():
            self._wake.set()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:  # spans from elsewhere (none in m3gate): exported as they are
        if not self._closed:
            self._queue.append(span)

    def _work(self) -> None:
        while not self._closed:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._export()
        self._export()

    def _export(self) -> None:
        queue, size, build = self._queue, self._batch, self.build
        with self._export_lock:
            token = context.attach(context.set_value(context._SUPPRESS_INSTRUMENTATION_KEY, True))
            try:
                batch: list[ReadableSpan] = []
                while queue:
                    item = queue.popleft()
                    if isinstance(item, ReadableSpan):
                        batch.append(item)
                    else:
                        try:
                            batch.extend(build(item))
                        except Exception:  # noqa: BLE001 - one odd request must not stop the others' export
                            log.exception("building a request's spans failed")
                    if len(batch) >= size:
                        self._send(batch[:size])
                        del batch[:size]
                if batch:
                    self._send(batch)
            finally:
                context.detach(token)

    def _send(self, batch: list[ReadableSpan]) -> None:
        try:
            self.exporter.export(batch)
        except Exception:  # noqa: BLE001 - an exporter bug must not kill the worker
            log.exception("exporting %d spans failed", len(batch))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if not self._closed:
            self._export()
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(30)
        self.exporter.shutdown()


class SyncSpans(SpanProcessor):
    """Builds and exports each request's spans as it ends, in the caller's thread (tests with an in-memory
    exporter). The exporter is the caller's: shutting this down leaves it open (a reload may hand it to the next
    pipeline)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self.build: Callable[[Any], list[ReadableSpan]] = _no_spans

    def defer(self, snapshot: tuple[Any, ...]) -> None:
        self.exporter.export(self.build(snapshot))

    def on_end(self, span: ReadableSpan) -> None:
        self.exporter.export([span])

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _no_spans(snapshot: Any) -> list[ReadableSpan]:
    return []


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, env.get(name), default)
        return default


# ----------------------------------------------------------------------------------------------------------------
# Finished spans, built cheaply


class _Span(ReadableSpan):
    """A ReadableSpan set up with plain assignments; resource and scope are class attributes of a per-pipeline
    subclass (`Tracing._span_class`). What exporters read is exactly ReadableSpan's."""

    _instrumentation_info = None
    _links: tuple[Any, ...] = ()

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind, start: int,
                 end: int, attributes: dict[str, Any], events: tuple[Event, ...] | list[Event] = (),
                 status: Status = UNSET) -> None:
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._start_time = start
        self._end_time = end
        self._attributes = attributes
        self._events = events
        self._status = status


class _Event(Event):
    def __init__(self, name: str, timestamp: int, attributes: dict[str, Any] | None = None) -> None:
        self._name = name
        self._timestamp = timestamp
        self._attributes = attributes if attributes is not None else _NO_ATTRIBUTES


_NO_ATTRIBUTES: dict[str, Any] = {}
_new_tuple = tuple.__new__


def _session_values(turn: Any) -> tuple[Any, ...]:
    """The server span's session attributes (SERVER_KEYS' session part), None where there is no session."""
    if turn is None:
        return _NO_SESSION
    t = turn.turn
    link = turn.previous_span
    return (turn.trace_id, turn.trace_id, turn.source, t.index, t.kind, turn.cache_path or None,
            t.wait_s * 1000 if t.wait_kind == "tool" else None, t.wait_s * 1000 if t.wait_kind == "think" else None,
            link[0] if link else None, link[1] if link else None)


_NO_SESSION = (None,) * 10


def _context(trace_id: int, span_id: int, state: TraceState) -> SpanContext:
    """SpanContext(trace_id, span_id, False, SAMPLED, state) without its range checks (our ids are valid)."""
    return _new_tuple(SpanContext, (trace_id, span_id, False, SAMPLED, state, True))


def _ratio_bound(sampler: Any) -> int | None:
    """The sampler as an integer bound on the trace id's low 64 bits, when it is the parent-based trace-id ratio (or
    always-on) sampler with its default delegates: then `begin` decides without calling it. None: call it."""
    if not isinstance(sampler, ParentBased):  # the class itself, or OTEL_TRACES_SAMPLER's parentbased_* subclasses
        return None
    delegates = (getattr(sampler, "_remote_parent_sampled", None), getattr(sampler, "_remote_parent_not_sampled", None))
    if delegates != (ALWAYS_ON, ALWAYS_OFF):
        return None
    root = getattr(sampler, "_root", None)
    if root is ALWAYS_ON:
        return 1 << 64
    if root is ALWAYS_OFF:
        return 0
    if type(root) is TraceIdRatioBased:
        return int(root.bound)
    return None


# ----------------------------------------------------------------------------------------------------------------
# Per-request trace state and span building


class TraceIds:
    """What a request carries between the hooks: ids, the sampling decision, a clock anchor, the pipeline."""

    __slots__ = ("trace_id", "span_id", "parent", "sampled", "trace_state", "offset_ns", "attempts", "owner", "_hex")

    def __init__(self, owner: Tracing, trace_id: int, span_id: int, parent: SpanContext | None, sampled: bool,
                 trace_state: TraceState, offset_ns: int) -> None:
        self.owner = owner  # the pipeline that sampled it, which builds and exports its spans even after a reload
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent = parent
        self.sampled = sampled
        self.trace_state = trace_state
        self.offset_ns = offset_ns  # wall-clock ns = offset_ns + monotonic s * 1e9
        self.attempts: list[tuple[int, float, str, str, str]] = []  # (span id, start, pool, endpoint, P/D role)
        self._hex = ""

    @property
    def trace_id_hex(self) -> str:
        if not self._hex:
            self._hex = f"{self.trace_id:032x}"
        return self._hex

    def wall_ns(self, t: float) -> int:
        return self.offset_ns + int(t * 1e9)


class Tracing:
    """One trace pipeline (provider, sampler, exporter): chooses ids at arrival, injects traceparent per attempt,
    builds the span tree when the request ends. A reload that changes tracing settings builds a new one; the old one
    finishes the requests it sampled, then shuts down (`retire`)."""

    def __init__(self, provider: TracerProvider, processor: SpanBatcher | SyncSpans, model: Callable[[], str],
                 clock: Callable[[], float], wall_ns: Callable[[], int]) -> None:
        self.provider = provider
        self.processor = processor
        self._sampler = provider.sampler
        self._bound = _ratio_bound(provider.sampler)
        self._new_span_id = provider.id_generator.generate_span_id
        self._new_trace_id = provider.id_generator.generate_trace_id
        self._span_class = type("Span", (_Span,), {
            "_resource": provider.resource, "_instrumentation_scope": InstrumentationScope("m3gate", _version())})
        self._propagator = TraceContextTextMapPropagator()
        self._model = model
        self._clock = clock
        self._wall_ns = wall_ns
        self.in_flight = 0  # sampled requests begun here and not finished
        self.retiring = False
        self.closed = False
        processor.build = self.build_spans

    @classmethod
    def build(cls, cfg: TracingConfig, env: Mapping[str, str], model: Callable[[], str], clock: Callable[[], float],
              span_exporter: SpanExporter | None = None) -> Tracing | None:
        """None when tracing is off. A given `span_exporter` (tests) turns it on and exports synchronously."""
        if span_exporter is None and not tracing_enabled(cfg, env):
            return None
        processor: SpanBatcher | SyncSpans
        if span_exporter is not None:
            processor = SyncSpans(span_exporter)
        else:
            processor = SpanBatcher(build_exporter(cfg, env), env)  # exports from its own thread
        tracing = cls(build_provider(cfg, env, processor), processor, model, clock, time.time_ns)
        if (tracing._bound == 1 << 64 and isinstance(processor, SpanBatcher)
                and not isinstance(processor.exporter, DiscardingSpanExporter)):
            log.warning("tracing samples every request: exporting a streamed request's spans costs ~125 µs of CPU "
                        "(~30% of the gateway's own per request); set telemetry.tracing.sample_ratio (0.01 keeps "
                        "the total telemetry cost under 5%) or OTEL_TRACES_SAMPLER_ARG")
        return tracing

    # hooks -----------------------------------------------------------------------------------------------------
    def begin(self, record: RequestRecord, headers: Mapping[str, str]) -> TraceIds:
        parent: SpanContext | None = None
        parent_context = None
        if "traceparent" in headers:
            parent_context = self._propagator.extract(headers)
            parent = get_current_span(parent_context).get_span_context()
            if not parent.is_valid:
                parent, parent_context = None, None
        trace_id = parent.trace_id if parent is not None else self._new_trace_id()
        bound = self._bound
        if bound is not None:  # parent-based ratio: the caller's decision, else the trace id's low bits
            if parent is not None:
                sampled, state = parent.trace_flags.sampled, parent.trace_state
            else:
                sampled, state = (trace_id & 0xFFFFFFFFFFFFFFFF) < bound, _EMPTY_STATE
        else:
            result = self._sampler.should_sample(parent_context, trace_id, record.api, SpanKind.SERVER)
            sampled = result.decision.is_sampled()
            state = result.trace_state or (parent.trace_state if parent is not None else _EMPTY_STATE)
        if not sampled:  # nothing to export: only the ids its traceparent passes on
            return TraceIds(self, trace_id, 0, parent, False, state, 0)
        self.in_flight += 1
        offset = self._wall_ns() - int(record.t_arrival * 1e9)
        return TraceIds(self, trace_id, self._new_span_id(), parent, True, state, offset)

    def attempt(self, record: RequestRecord, ids: TraceIds, headers: MutableMapping[str, str]) -> None:
        span_id = self._new_span_id()
        if ids.sampled:
            pd = record.pd
            role = pd.role if pd is not None else ""
            ids.attempts.append((span_id, self._clock(), record.pool, record.replica, role))
        headers["traceparent"] = f"00-{ids.trace_id_hex}-{span_id:016x}-{'01' if ids.sampled else '00'}"
        state = ids.trace_state
        if state is not _EMPTY_STATE and state:
            headers["tracestate"] = state.to_header()
        else:
            headers.pop("tracestate", None)  # the caller's, copied with its headers, belongs to its own parent

    def end(self, record: RequestRecord, ids: TraceIds, now: float) -> None:
        self.processor.defer(self.snapshot(record, ids, now))  # its spans are built by the export worker

    # span tree -------------------------------------------------------------------------------------------------
    def snapshot(self, record: RequestRecord, ids: TraceIds, now: float) -> tuple[Any, ...]:
        """What the spans need, read now (the record is the gateway's), as one flat tuple of numbers, strings and
        None, which the garbage collector stops tracking at its first pass (see SpanBatcher): 21 fields, then the
        server span's attribute values in SERVER_KEYS' order (None: absent), then 5 fields per attempt."""
        usage = record.usage
        input_tokens = output_tokens = cached = None
        if usage:
            input_tokens, output_tokens, cached = record.tokens()
        err = error_type(record)
        attempts = ids.attempts
        first_send = attempts[0][1] if attempts else record.t_sent
        api, arrival, status, gone = record.api, record.t_arrival, record.status, record.client_disconnected
        admitted, routed, first = record.t_admitted, record.t_routed, record.t_first_byte
        pool = record.pool or record.first_pool or None
        replica = record.replica or None
        path = record.path
        streamed = record.stream and status == 200 and first
        attempt_error = None
        if status >= 500 or (record.error or "").startswith("upstream"):
            attempt_error = record.error or str(status)
        parent, state = ids.parent, ids.trace_state
        return (
            # the fixed fields (_FIXED of them)
            ids.trace_id, ids.span_id, None if state is _EMPTY_STATE or not state else state.to_header(),
            ids.offset_ns, None if parent is None else parent.span_id, 0 if parent is None else int(parent.trace_flags),
            record.t_last_byte or now, arrival, admitted if admitted - routed >= QUEUED_S else 0.0, record.t_sent,
            record.t_headers, first if streamed else 0.0, status, status if status and not gone else 0, attempt_error,
            (err or str(status)) if status >= 500 or err in _BAD_ERRORS else None, path, input_tokens, output_tokens,
            cached, tuple(record.migration_events) if record.migration_events else None,
            # the server span's attribute values, in SERVER_KEYS' order
            OPERATION.get(api, api), self._model(), record.stream, "POST", path, 499 if gone else status, api,
            record.thinking_mode, record.attempts, record.max_tokens, input_tokens, output_tokens, cached,
            pool,
            (record.traffic_class or pool) if pool else None,
            record.pool_reason if pool else None,
            record.prompt_tokens_est if pool else None,
            (record.t_classified - arrival) * 1000 if record.t_classified else None,
            max(0.0, admitted - routed) * 1000 if admitted else None,
            replica,
            record.matched_blocks if replica else None,
            routing_reason(record) if replica else None,
            gateway_overhead_s(record, first_send) * 1000 if first_send else None,
            first - arrival if streamed and not gone else None,
            err,
            True if gone else None,
            *_session_values(record.session),
            # the attempts, 5 fields each
            *(attempts[0] if len(attempts) == 1 else [field for attempt in attempts for field in attempt]),
        )

    def spans(self, record: RequestRecord, ids: TraceIds, now: float) -> list[ReadableSpan]:
        """The request's spans, server span last (built at once; tests and tools)."""
        return self.build_spans(self.snapshot(record, ids, now))

    def build_spans(self, snapshot: tuple[Any, ...]) -> list[ReadableSpan]:
        """The spans of one request (export worker): 4 for a streamed request, 2 for a plain one, +1 per retry.
        Stage durations that need no bar of their own are attributes (classify, upstream headers), rare stages are
        events."""
        (trace_id, server_id, state_header, offset, caller, caller_flags, end, arrival, waited, sent, headers_at,
         first, status_code, response_code, attempt_error, server_error, path, input_tokens, output_tokens,
         cached, migrations) = snapshot[:_FIXED]
        values = snapshot[_FIXED:_ATTEMPTS]
        fields = iter(snapshot[_ATTEMPTS:])
        attempts = list(zip(fields, fields, fields, fields, fields))  # (span id, start, pool, endpoint, P/D role)
        Span = self._span_class
        state = _EMPTY_STATE if state_header is None else TraceState.from_header([state_header])
        server = _context(trace_id, server_id, state)
        parent = None if caller is None else _new_tuple(SpanContext, (
            trace_id, caller, True, SAMPLED if caller_flags == 1 else TraceFlags(caller_flags), state, True))
        end_ns = offset + int(end * 1e9)
        out: list[ReadableSpan] = []
        events: list[Event] | tuple[()] = ()
        if waited or migrations:  # the admission queue held it (a millisecond or more); resumed mid-stream
            events = [*([_Event("m3gate.admitted", offset + int(waited * 1e9))] if waited else ()),
                      *_migration_events(migrations or (), offset)]
        name = "POST " + path
        last = len(attempts) - 1
        for i, (span_id, started, pool, endpoint, role) in enumerate(attempts):
            attempt_attrs: dict[str, Any] = {"http.request.method": "POST", "url.full": endpoint + path,
                                             "m3gate.pool": pool, "m3gate.endpoint": endpoint, "m3gate.attempt": i + 1}
            context = _context(trace_id, span_id, state)
            if role:  # a disaggregated pool's prefill or decode call (gateway/disagg.py)
                attempt_attrs["m3gate.pd.role"] = role
            if role == "prefill" and i < last and attempts[i + 1][4] == "decode":  # prefilled: the KV went on
                start_ns = offset + int(started * 1e9)
                out.append(Span(name, context, server, CLIENT, start_ns,
                                max(start_ns, offset + int(attempts[i + 1][1] * 1e9)), attempt_attrs))
                continue
            if i < last:  # failed before its first byte, then retried elsewhere
                start_ns = offset + int(started * 1e9)
                stopped_ns = offset + int(attempts[i + 1][1] * 1e9)
                out.append(Span(name, context, server, CLIENT, start_ns, max(start_ns, stopped_ns), attempt_attrs,
                                (), _RETRIED))
                events = [*events, _Event("m3gate.retry", stopped_ns, {
                    "m3gate.pool": pool, "m3gate.endpoint": endpoint, "m3gate.attempt": i + 1})]
                continue
            sent = sent or started
            sent_ns = offset + int(sent * 1e9)
            if response_code:
                attempt_attrs["http.response.status_code"] = response_code
            if headers_at >= sent:  # connect + send + the replica accepting it
                attempt_attrs["m3gate.upstream.headers_ms"] = (headers_at - sent) * 1000
            out.append(Span(name, context, server, CLIENT, sent_ns, max(sent_ns, end_ns), attempt_attrs, (),
                            UNSET if attempt_error is None else Status(StatusCode.ERROR, attempt_error)))
            if first and headers_at >= sent:
                out.extend(self._stage_spans(snapshot, context, state, role, sent_ns))
        attrs = {key: value for key, value in zip(SERVER_KEYS, values) if value is not None}
        link_trace, link_span = attrs.pop(_LINK_TRACE, None), attrs.pop(_LINK_SPAN, None)
        span = Span(values[0] + " " + values[1], server, parent, SERVER, offset + int(arrival * 1e9), end_ns,
                    attrs, events, UNSET if server_error is None else Status(StatusCode.ERROR, server_error))
        if link_span is not None:  # the session's previous turn
            span._links = (Link(_context(link_trace, link_span, _EMPTY_STATE), {"m3gate.link": "previous_turn"}),)
        out.append(span)
        return out

    def _stage_spans(self, snapshot: tuple[Any, ...], attempt: SpanContext, state: TraceState, role: str,
                     sent_ns: int) -> tuple[ReadableSpan, ReadableSpan]:
        """A stream's two stages under its final attempt: sent → first token (`m3gate.prefill`; for a P/D decode
        call `m3gate.kv_transfer`: the KV pull and one step), then first → last token (`m3gate.decode`)."""
        trace_id, offset, end, first = snapshot[0], snapshot[3], snapshot[6], snapshot[11]
        input_tokens, output_tokens, cached = snapshot[17], snapshot[18], snapshot[19]
        Span, new_id = self._span_class, self._new_span_id
        first_ns, end_ns = offset + int(first * 1e9), offset + int(end * 1e9)
        prefill: dict[str, Any] = {}
        if input_tokens is not None:
            prefill["gen_ai.usage.input_tokens"] = input_tokens
        if cached is not None:
            prefill["gen_ai.usage.cache_read.input_tokens"] = cached
        decode: dict[str, Any] = {}
        if output_tokens is not None:
            decode["gen_ai.usage.output_tokens"] = output_tokens
            if output_tokens > 1:
                decode["m3gate.tpot_ms"] = (end - first) * 1000 / (output_tokens - 1)
        name = "m3gate.kv_transfer" if role == "decode" else "m3gate.prefill"
        return (Span(name, _context(trace_id, new_id(), state), attempt, INTERNAL, sent_ns, max(sent_ns, first_ns),
                     prefill),
                Span("m3gate.decode", _context(trace_id, new_id(), state), attempt, INTERNAL, first_ns,
                     max(first_ns, end_ns), decode))

    # lifecycle -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Export what is queued and shut the exporter down (blocking: the network may be slow)."""
        if not self.closed:
            self.closed = True
            self.provider.shutdown()

    def close_in_background(self) -> None:
        if not self.closed:
            self.closed = True
            threading.Thread(target=self.provider.shutdown, name="m3gate-tracing-close", daemon=True).start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)  # flushing may wait on the network: off the event loop


_EMPTY_STATE = TraceState()
_RETRIED = Status(StatusCode.ERROR, "failed before the first byte; retried")
_LINK_TRACE, _LINK_SPAN = "m3gate.link.trace_id", "m3gate.link.span_id"
def _migration_events(migrations: tuple[tuple[float, int, str], ...], offset: int) -> list[Event]:
    """One `m3gate.migration` event per resumption: the generated tokens kept at the cut and the new endpoint."""
    return [_Event("m3gate.migration", offset + int(at * 1e9), {"m3gate.migration.tokens": tokens,
                                                                "m3gate.endpoint": endpoint})
            for at, tokens, endpoint in migrations]


SERVER_KEYS = (  # the server span's attributes, in the order of Tracing.snapshot's values
    "gen_ai.operation.name", "gen_ai.request.model", "gen_ai.request.stream", "http.request.method", "url.path",
    "http.response.status_code", "m3gate.api", "m3gate.thinking_mode", "m3gate.attempts", "gen_ai.request.max_tokens",
    "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.usage.cache_read.input_tokens",
    "m3gate.pool", "m3gate.class", "m3gate.pool.reason", "m3gate.prompt_tokens_estimate",
    "m3gate.classify_ms",  # body read, classification (token counting) and pool choice
    "m3gate.queue_wait_ms",  # the admission step, its queue wait included
    "m3gate.endpoint", "m3gate.prefix.matched_blocks", "m3gate.routing.reason",
    "m3gate.gateway_overhead_ms",  # the gateway's own share before the first upstream attempt
    "gen_ai.response.time_to_first_chunk", "error.type", "m3gate.client_disconnected",
    # agent sessions (gateway/sessions.py): the id as sessions.trace_ids says, how it was found, the turn
    "gen_ai.conversation.id", "session.id", "m3gate.session.id_source", "m3gate.turn.index", "m3gate.turn.kind",
    "m3gate.cache_path", "m3gate.tool_turnaround_ms", "m3gate.user_think_ms",
    _LINK_TRACE, _LINK_SPAN,  # not attributes: the previous turn's server span, linked
)
_FIXED = 21  # Tracing.snapshot's fixed fields, before the server attribute values
_ATTEMPTS = _FIXED + len(SERVER_KEYS)  # where the attempts' fields start
QUEUED_S = 0.001  # an admission step this long or longer waited in the queue: the span gets an event
_BAD_ERRORS = frozenset({"stream_incomplete", "stream_broken", "other"})
SERVER, CLIENT, INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL


# ----------------------------------------------------------------------------------------------------------------
# The P/D path's tables

PD_BUCKETS = (*STAGE_BUCKETS, 60.0, 120.0, 300.0)


class PDMetrics:
    """The disaggregated path's decisions and stages (gateway/disagg.py), built with the metrics registry."""

    def __init__(self, registry: Any) -> None:
        labels = ("pool", "class")
        self.decisions = CounterTable(registry, "m3gate_pd_decisions", "Requests to disaggregated pools by the "
                                      "decider's path (disaggregated, decode_short, decode_cached, decode_no_prefill, "
                                      "decode_unsupported).", ("pool", "path"))
        self.stages = {
            "prefill": HistogramTable(registry, "m3gate_pd_prefill_seconds", "Disaggregated requests: the prefill "
                                      "call (sent to the prefill replica until its answer).", labels, PD_BUCKETS),
            "transfer": HistogramTable(registry, "m3gate_pd_transfer_seconds", "Disaggregated streams: sent to the "
                                       "decode replica until its first token (KV pull + one step).", labels,
                                       PD_BUCKETS),
            "decode": HistogramTable(registry, "m3gate_pd_decode_seconds", "Disaggregated requests: first to last "
                                     "token on the decode replica (non-streamed: the whole decode call).", labels,
                                     PD_BUCKETS),
        }

    def decision(self, pool: str, path: str) -> None:
        if not self.decisions.values:  # every path's series from the first decision on
            for each in PATHS:
                self.decisions.values.setdefault((pool, each), 0.0)
        self.decisions.inc((pool, path))

    def stage(self, stage: str, record: RequestRecord, seconds: float) -> None:
        self.stages[stage].observe((record.pool, record.traffic_class or record.pool), max(0.0, seconds))


# ----------------------------------------------------------------------------------------------------------------
# The gateway's facade


class Telemetry:
    """Metrics (on by default) and traces (off by default) for one Gateway; its per-request hooks; reloads."""

    DRAIN_S = 600.0  # a replaced trace pipeline waits this long at most for the requests it sampled

    def __init__(self, gateway: Any, span_exporter: SpanExporter | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.gateway = gateway
        cfg: TelemetryConfig = getattr(gateway.config, "telemetry", None) or TelemetryConfig()
        self._cfg = cfg
        self._env: Mapping[str, str] = os.environ if env is None else env
        self._span_exporter = span_exporter
        self._clock: Callable[[], float] = gateway.clock
        self._registry = GatewayMetrics(gateway) if cfg.metrics else None  # kept while metrics are off
        self.metrics = self._registry
        self._pd = PDMetrics(self._registry.registry) if self._registry is not None else None
        self.tracing = self._build_tracing(cfg)
        self._retiring: set[Tracing] = set()
        self._off = self.metrics is None and self.tracing is None
        # the replicas' llm_request spans, joined to sampled attempts (gateway/observability/engine_spans.py)
        self.engine_spans = EngineSpans(lambda: self.metrics.requests if self.metrics is not None else None,
                                        self._clock)
        if self._registry is not None:
            self._registry.registry.register(self.engine_spans)
        self._configure_engine_spans(cfg)

    def _build_tracing(self, cfg: TelemetryConfig) -> Tracing | None:
        return Tracing.build(cfg.tracing, self._env, lambda: self.gateway.config.model, self._clock,
                             self._span_exporter)

    def _configure_engine_spans(self, cfg: TelemetryConfig) -> None:
        """The replicas' spans are received while tracing is on and asked for; they are forwarded through an
        exporter of the gateway's own settings (OTLP only; none when tests hand in their own exporter)."""
        on = cfg.tracing.receive_engine_spans and self.tracing is not None
        exporter = None
        if on and self._span_exporter is None:
            try:
                exporter = build_exporter(cfg.tracing, self._env)
            except Exception:  # noqa: BLE001 - the trace pipeline was built with the same settings; be safe anyway
                log.exception("telemetry: no exporter to forward the replicas' spans with")
        self.engine_spans.configure(cfg.tracing, on, exporter)

    # per-request hooks -----------------------------------------------------------------------------------------
    def start(self, record: RequestRecord, headers: Mapping[str, str]) -> None:
        """At arrival: count the request in flight; pick its trace ids (honouring an incoming traceparent)."""
        if self._off:
            return
        if self.metrics is not None:
            self.metrics.started(record.api)
        if self.tracing is not None:
            record.trace = self.tracing.begin(record, headers)

    def inject(self, record: RequestRecord, headers: MutableMapping[str, str]) -> None:
        """Before each upstream attempt: traceparent naming this attempt's span, so vLLM's span joins the trace;
        for a stream, the inter-token latency series its relay feeds chunk by chunk."""
        ids: TraceIds | None = record.trace
        if ids is not None:
            ids.owner.attempt(record, ids, headers)
            if ids.sampled and self.engine_spans.enabled:  # its replica's llm_request span will name this attempt
                self.engine_spans.remember(ids.trace_id, ids.attempts[-1][0], record.pool,
                                           record.traffic_class or record.pool, record)
        if record.stream and self.metrics is not None:
            record.itl = self.metrics.requests.itl_series(record)

    def finish(self, record: RequestRecord) -> None:
        """Once, when the request is over however it ended: histograms, then the span tree (if sampled)."""
        ids: TraceIds | None = record.trace
        if self._off and ids is None:
            return
        try:
            now = self._clock()
            metrics = self.metrics
            sampled = ids is not None and ids.sampled
            if metrics is not None:
                metrics.finished(record, now, ids.trace_id_hex if sampled else None)
            if not sampled:
                return
            owner = ids.owner
            owner.in_flight -= 1
            if len(ids.attempts) > 1:  # only the final attempt's replica span counts; retried ones are forgotten
                for attempt in ids.attempts[:-1]:
                    self.engine_spans.forget(attempt[0])
            owner.end(record, ids, now)
            if owner.retiring and owner.in_flight <= 0:
                self._close(owner)
        except Exception:  # noqa: BLE001 - telemetry must never fail a request
            log.exception("telemetry failed for a %s request", record.api)

    def migration(self, record: RequestRecord, outcome: str, tokens: int, endpoint: str) -> None:
        """A stream's replica failed after its first byte: `outcome` resumed (on `endpoint`, from `tokens` generated
        tokens), failed or refused. The span gets an `m3gate.migration` event per resumption."""
        if outcome == "resumed":
            record.migrations += 1
            if record.migration_events is None:
                record.migration_events = []
            record.migration_events.append((self._clock(), tokens, endpoint))
        if self.metrics is not None:
            self.metrics.requests.migrations.inc((record.pool or "none", outcome))

    def pause(self, pool: str, cls: str) -> None:
        """A background stream of `cls` admitted to `pool` was paused for foreground work."""
        if self.metrics is not None:
            self.metrics.requests.pauses.inc((pool, cls))

    def pd_decision(self, pool: str, path: str) -> None:
        """A disaggregated pool's decider chose `path` for a request."""
        if self.metrics is not None and self._pd is not None:
            self._pd.decision(pool, path)

    def pd_stage(self, stage: str, record: RequestRecord, seconds: float) -> None:
        """A disaggregated request's prefill, transfer or decode stage took `seconds`."""
        if self.metrics is not None and self._pd is not None:
            self._pd.stage(stage, record, seconds)

    # reloads ---------------------------------------------------------------------------------------------------
    def apply_config(self, config: Any) -> bool:
        """A reload: apply changed telemetry settings now. Metrics on/off (the registry is kept while off, so
        counters go on when they come back); tracing on/off, exporter, endpoint, sampling, service name (a new
        pipeline takes new requests; the old one still builds and exports the spans of the requests it sampled, then
        shuts down). Series of removed pools and replicas are dropped. True when a new metrics registry was made
        (the caller registers its own collectors in it)."""
        cfg: TelemetryConfig = getattr(config, "telemetry", None) or TelemetryConfig()
        old, self._cfg = self._cfg, cfg
        created = False
        if cfg.metrics and self.metrics is None:
            created = self._registry is None
            if created:
                self._registry = GatewayMetrics(self.gateway)
                self._registry.registry.register(self.engine_spans)
                self._pd = PDMetrics(self._registry.registry)
            else:
                assert self._registry is not None
                self._registry.resume(self._clock())
            self.metrics = self._registry
            log.warning("telemetry: metrics turned on")
        elif not cfg.metrics and self.metrics is not None:
            self.metrics = None
            log.warning("telemetry: metrics turned off (GET /metrics answers 404)")
        if self.metrics is not None:
            self.metrics.pruner.prune()
        if cfg.tracing != old.tracing:
            try:
                fresh = self._build_tracing(cfg)
            except Exception:  # noqa: BLE001 - a bad exporter setting keeps the running pipeline
                log.exception("telemetry: the new tracing settings failed; the previous ones stay in effect")
                self._cfg = self._cfg.model_copy(update={"tracing": old.tracing})
            else:
                previous, self.tracing = self.tracing, fresh
                if previous is not None:
                    self._retire(previous)
                self._configure_engine_spans(cfg)
                log.warning("telemetry: tracing %s", "reconfigured" if fresh is not None else "turned off")
        self._off = self.metrics is None and self.tracing is None
        return created

    def _retire(self, tracing: Tracing) -> None:
        tracing.retiring = True
        if tracing.in_flight <= 0:
            self._close(tracing)
            return
        self._retiring.add(tracing)
        try:
            asyncio.get_running_loop().call_later(self.DRAIN_S, self._close, tracing)
        except RuntimeError:  # no loop (tests driving the hooks by hand): the last request closes it
            pass

    def _close(self, tracing: Tracing) -> None:
        """Shut a replaced pipeline down in a thread: its exporter may block on the network while flushing."""
        self._retiring.discard(tracing)
        tracing.close_in_background()

    # other hooks -----------------------------------------------------------------------------------------------
    def config_reloaded(self, ok: bool) -> None:
        """Called by the reload code after each attempt (file watch, SIGHUP, admin)."""
        if self.metrics is not None:
            self.metrics.config_reloaded(ok)

    def set_redis_up(self, up: bool) -> None:
        """Called by the shared-state code when Redis becomes reachable or unreachable."""
        if self.metrics is not None:
            self.metrics.set_redis_up(up)

    async def shutdown(self) -> None:
        """Flush exporters (the current pipeline and any still draining after a reload)."""
        for tracing in [*self._retiring, *([self.tracing] if self.tracing is not None else [])]:
            await tracing.shutdown()
        self._retiring.clear()
        await asyncio.to_thread(self.engine_spans.close)
