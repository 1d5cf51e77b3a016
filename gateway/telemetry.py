"""Traces and metrics for each request, built from its `RequestRecord`.

The gateway calls three hooks per request: `start` at arrival, `inject` before each upstream attempt, and `finish`
exactly once when the request is over, however it ended.

Spans are not kept open while a request runs. `start` and `inject` only choose ids (honouring an incoming W3C
`traceparent` and the sampler) and put a `traceparent` on the upstream call, so vLLM's own `llm_request` span joins
the trace under the gateway's attempt span. `finish` then builds the whole span tree at once, with explicit start and
end times taken from the record's timestamps, and hands the finished spans to the exporter's span processor. That
costs ~20 µs per traced request where the SDK's live-span API costs ~120 µs, and a request that dies half-way leaves
no open span behind. With tracing off the hooks do nothing but the metrics.

Span tree of one request:

    SERVER  "chat MiniMaxAI/MiniMax-M3"           arrival → last byte (gen_ai.* and m3gate.* attributes)
      ├─ m3gate.classify                         arrival → classified (body read, classification, pool choice)
      │                                          (replica choice, until the first attempt, is in gateway_overhead_ms)
      ├─ m3gate.queue                            routed → admitted (only when the admission queue held it)
      ├─ CLIENT "POST /v1/chat/completions"      one per attempt; its id is the traceparent vLLM receives
      │    ├─ m3gate.upstream.send               sent → response headers (connect, send, replica accepted)
      │    ├─ m3gate.prefill                     sent → first token's event
      │    └─ m3gate.decode                      first → last token's event (output tokens, TPOT)
      └─ event m3gate.retry                      when an attempt failed before its first byte and was retried
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from importlib import metadata
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from gateway.metrics import GatewayMetrics, error_type, gateway_overhead_s, routing_reason
from gateway.relay import RequestRecord
from pools.config import TelemetryConfig, TracingConfig

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
# Per-request trace state and span building


class TraceIds:
    """What a request carries between the hooks: ids, the sampling decision and a clock anchor."""

    __slots__ = ("trace_id", "span_id", "parent", "sampled", "trace_state", "anchor_mono", "anchor_wall_ns",
                 "attempts")

    def __init__(self, trace_id: int, span_id: int, parent: SpanContext | None, sampled: bool,
                 trace_state: TraceState, anchor_mono: float, anchor_wall_ns: int) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent = parent
        self.sampled = sampled
        self.trace_state = trace_state
        self.anchor_mono = anchor_mono
        self.anchor_wall_ns = anchor_wall_ns
        self.attempts: list[tuple[int, float, str, str]] = []  # (span id, start, pool, endpoint)

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def wall_ns(self, t: float) -> int:
        return self.anchor_wall_ns + int((t - self.anchor_mono) * 1e9)

    def traceparent(self, span_id: int) -> str:
        return f"00-{self.trace_id:032x}-{span_id:016x}-{'01' if self.sampled else '00'}"


class Tracing:
    """Chooses ids at arrival, injects traceparent per attempt, builds the span tree when the request ends."""

    def __init__(self, provider: TracerProvider, processor: SpanProcessor, model: Callable[[], str],
                 clock: Callable[[], float], wall_ns: Callable[[], int]) -> None:
        self.provider = provider
        self._processor = processor
        self._sampler = provider.sampler
        self._ids = provider.id_generator
        self._resource = provider.resource
        self._scope = InstrumentationScope("m3gate", _version())
        self._propagator = TraceContextTextMapPropagator()
        self._model = model
        self._clock = clock
        self._wall_ns = wall_ns

    @classmethod
    def build(cls, cfg: TracingConfig, env: Mapping[str, str], model: Callable[[], str], clock: Callable[[], float],
              span_exporter: SpanExporter | None = None) -> Tracing | None:
        """None when tracing is off. A given `span_exporter` (tests) turns it on and exports synchronously."""
        if span_exporter is None and not tracing_enabled(cfg, env):
            return None
        if span_exporter is not None:
            processor: SpanProcessor = SimpleSpanProcessor(span_exporter)
        else:
            processor = BatchSpanProcessor(build_exporter(cfg, env))  # exports from its own thread
        return cls(build_provider(cfg, env, processor), processor, model, clock, time.time_ns)

    # hooks -----------------------------------------------------------------------------------------------------
    def begin(self, record: RequestRecord, headers: Mapping[str, str]) -> TraceIds:
        parent_context = self._propagator.extract(headers) if "traceparent" in headers else None
        parent = get_current_span(parent_context).get_span_context() if parent_context is not None else None
        if parent is not None and not parent.is_valid:
            parent, parent_context = None, None
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        result = self._sampler.should_sample(parent_context, trace_id, record.api, SpanKind.SERVER)
        trace_state = result.trace_state or (parent.trace_state if parent is not None else TraceState())
        return TraceIds(trace_id, self._ids.generate_span_id(), parent, result.decision.is_sampled(),
                        trace_state, record.t_arrival, self._wall_ns())

    def attempt(self, record: RequestRecord, ids: TraceIds, headers: MutableMapping[str, str]) -> None:
        span_id = self._ids.generate_span_id()
        ids.attempts.append((span_id, self._clock(), record.pool, record.replica))
        headers["traceparent"] = ids.traceparent(span_id)
        if ids.trace_state:
            headers["tracestate"] = ids.trace_state.to_header()
        else:
            headers.pop("tracestate", None)  # the caller's, copied with its headers, belongs to its own parent

    def end(self, record: RequestRecord, ids: TraceIds, now: float) -> None:
        for span in self.spans(record, ids, now):
            self._processor.on_end(span)

    # span tree -------------------------------------------------------------------------------------------------
    def spans(self, record: RequestRecord, ids: TraceIds, now: float) -> list[ReadableSpan]:
        trace_id, state, wall = ids.trace_id, ids.trace_state, ids.wall_ns
        server = SpanContext(trace_id, ids.span_id, False, SAMPLED, state)
        end = record.t_last_byte or now
        out: list[ReadableSpan] = []
        events: list[Event] = []

        def span(name: str, start: float, stop: float, attributes: dict[str, Any] | None = None,
                 parent: SpanContext = server, kind: SpanKind = SpanKind.INTERNAL, span_id: int | None = None,
                 status: Status | None = None) -> SpanContext:
            context = SpanContext(trace_id, span_id or self._ids.generate_span_id(), False, SAMPLED, state)
            out.append(ReadableSpan(
                name, context, parent, self._resource, attributes or {}, kind=kind, start_time=wall(start),
                end_time=wall(max(start, stop)), status=status or UNSET,
                instrumentation_scope=self._scope,
            ))
            return context

        first_send = ids.attempts[0][1] if ids.attempts else record.t_sent
        if record.t_classified:
            span("m3gate.classify", record.t_arrival, record.t_classified,
                 {"m3gate.prompt_tokens_estimate": record.prompt_tokens_est,
                  "m3gate.thinking_mode": record.thinking_mode, "m3gate.pool.reason": record.pool_reason})
        if record.t_admitted:
            span("m3gate.queue", record.t_routed, record.t_admitted)

        usage = record.usage or {}
        output_tokens = usage.get("completion_tokens") or usage.get("output_tokens")
        input_tokens = usage.get("prompt_tokens") or usage.get("input_tokens")
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        path = record.extra.get("path", "")
        for i, (span_id, started, pool, endpoint) in enumerate(ids.attempts):
            attrs: dict[str, Any] = {"http.request.method": "POST", "url.full": endpoint + path,
                                     "m3gate.pool": pool, "m3gate.endpoint": endpoint, "m3gate.attempt": i + 1}
            if i + 1 < len(ids.attempts):  # failed before its first byte, then retried elsewhere
                stopped = ids.attempts[i + 1][1]
                span(f"POST {path}", started, stopped, attrs, kind=SpanKind.CLIENT, span_id=span_id,
                     status=Status(StatusCode.ERROR, "failed before the first byte; retried"))
                events.append(Event("m3gate.retry", {"m3gate.pool": pool, "m3gate.endpoint": endpoint,
                                                     "m3gate.attempt": i + 1}, wall(stopped)))
                continue
            sent = record.t_sent or started
            if record.status and not record.client_disconnected:
                attrs["http.response.status_code"] = record.status
            failed = record.status >= 500 or (record.error or "").startswith("upstream")
            attempt = span(f"POST {path}", sent, end, attrs, kind=SpanKind.CLIENT, span_id=span_id,
                           status=Status(StatusCode.ERROR, record.error or str(record.status)) if failed else None)
            streamed = record.stream and record.t_first_byte and record.t_headers >= sent
            if record.t_headers >= sent and record.t_headers:
                span("m3gate.upstream.send" if streamed else "m3gate.upstream.wait", sent, record.t_headers,
                     parent=attempt)
            if streamed and record.status == 200:
                prefill: dict[str, Any] = {}
                if input_tokens is not None:
                    prefill["gen_ai.usage.input_tokens"] = input_tokens
                if cached is not None:
                    prefill["gen_ai.usage.cache_read.input_tokens"] = cached
                span("m3gate.prefill", sent, record.t_first_byte, prefill, parent=attempt)
                decode: dict[str, Any] = {}
                decode_s = end - record.t_first_byte
                if output_tokens is not None:
                    decode["gen_ai.usage.output_tokens"] = output_tokens
                    if output_tokens > 1:
                        decode["m3gate.tpot_ms"] = round(decode_s * 1000 / (output_tokens - 1), 3)
                span("m3gate.decode", record.t_first_byte, end, decode, parent=attempt)

        err = error_type(record)
        attrs = self._server_attributes(record, err, input_tokens, output_tokens, cached, first_send)
        bad = record.status >= 500 or err in ("stream_incomplete", "stream_broken", "other")
        out.append(ReadableSpan(
            f"{attrs['gen_ai.operation.name']} {attrs['gen_ai.request.model']}", server, ids.parent, self._resource,
            attrs, events=events, kind=SpanKind.SERVER, start_time=wall(record.t_arrival), end_time=wall(end),
            status=Status(StatusCode.ERROR, err or str(record.status)) if bad else UNSET,
            instrumentation_scope=self._scope,
        ))
        return out

    def _server_attributes(self, record: RequestRecord, err: str | None, input_tokens: Any, output_tokens: Any,
                           cached: Any, first_send: float) -> dict[str, Any]:
        status = 499 if record.client_disconnected else record.status
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": OPERATION.get(record.api, record.api),
            "gen_ai.request.model": self._model(),
            "gen_ai.request.stream": record.stream,
            "http.request.method": "POST",
            "url.path": record.extra.get("path", ""),
            "http.response.status_code": status,
            "m3gate.api": record.api,
            "m3gate.thinking_mode": record.thinking_mode,
            "m3gate.attempts": record.attempts,
        }
        if record.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = record.max_tokens
        if input_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = output_tokens
        if cached is not None:
            attrs["gen_ai.usage.cache_read.input_tokens"] = cached
        pool = record.pool or record.first_pool
        if pool:
            attrs.update({
                "m3gate.pool": pool,
                "m3gate.class": record.traffic_class or pool,
                "m3gate.pool.reason": record.pool_reason,
                "m3gate.prompt_tokens_estimate": record.prompt_tokens_est,
            })
        if record.replica:
            attrs.update({
                "m3gate.endpoint": record.replica,
                "m3gate.prefix.matched_blocks": record.matched_blocks,
                "m3gate.routing.reason": routing_reason(record),
            })
        if first_send:
            attrs["m3gate.gateway_overhead_ms"] = round(gateway_overhead_s(record, first_send) * 1000, 3)
        if record.stream and record.t_first_byte and record.status == 200 and not record.client_disconnected:
            attrs["gen_ai.response.time_to_first_chunk"] = round(record.t_first_byte - record.t_arrival, 6)
        if err is not None:
            attrs["error.type"] = err
        if record.client_disconnected:
            attrs["m3gate.client_disconnected"] = True
        return attrs

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.provider.shutdown)  # flushing may wait on the network: off the event loop


# ----------------------------------------------------------------------------------------------------------------
# The gateway's facade


class Telemetry:
    """Metrics (on by default) and traces (off by default) for one Gateway; its three per-request hooks."""

    def __init__(self, gateway: Any, span_exporter: SpanExporter | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.gateway = gateway
        cfg: TelemetryConfig = getattr(gateway.config, "telemetry", None) or TelemetryConfig()
        self._clock: Callable[[], float] = gateway.clock
        self.metrics = GatewayMetrics(gateway) if cfg.metrics else None
        self.tracing = Tracing.build(cfg.tracing, os.environ if env is None else env, lambda: gateway.config.model,
                                     gateway.clock, span_exporter)
        self._off = self.metrics is None and self.tracing is None

    def start(self, record: RequestRecord, headers: Mapping[str, str]) -> None:
        """At arrival: count the request in flight; pick its trace ids (honouring an incoming traceparent)."""
        if self._off:
            return
        if self.metrics is not None:
            self.metrics.started(record.api)
        if self.tracing is not None:
            record.trace = self.tracing.begin(record, headers)

    def inject(self, record: RequestRecord, headers: MutableMapping[str, str]) -> None:
        """Before each upstream attempt: traceparent naming this attempt's span, so vLLM's span joins the trace."""
        if self.tracing is not None and record.trace is not None:
            self.tracing.attempt(record, record.trace, headers)

    def finish(self, record: RequestRecord) -> None:
        """Once, when the request is over however it ended: histograms, then the span tree (if sampled)."""
        if self._off:
            return
        try:
            now = self._clock()
            ids: TraceIds | None = record.trace
            sampled = ids is not None and ids.sampled
            if self.metrics is not None:
                self.metrics.finished(record, now, ids.trace_id_hex if sampled and ids is not None else None)
            if sampled and self.tracing is not None and ids is not None:
                self.tracing.end(record, ids, now)
        except Exception:  # noqa: BLE001 - telemetry must never fail a request
            log.exception("telemetry failed for a %s request", record.api)

    def config_reloaded(self, ok: bool) -> None:
        """Called by the reload code after each attempt (file watch, SIGHUP, admin)."""
        if self.metrics is not None:
            self.metrics.config_reloaded(ok)

    def set_redis_up(self, up: bool) -> None:
        """Called by the shared-state code when Redis becomes reachable or unreachable."""
        if self.metrics is not None:
            self.metrics.set_redis_up(up)

    async def shutdown(self) -> None:
        """Flush exporters."""
        if self.tracing is not None:
            await self.tracing.shutdown()
