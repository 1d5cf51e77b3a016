"""Telemetry from crafted records: the span tree and its exact timings, trace propagation, sampling, OTEL_* switches,
and which metrics each outcome moves. No network: the gateway is a stub with a real config and real pools."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.observability.metrics import error_type, routing_reason, scrape_targets
from gateway.precise import PreciseRouting
from gateway.record import RequestRecord
from gateway.observability.telemetry import DiscardingSpanExporter, Telemetry, build_exporter, tracing_enabled
from policies.config import GatewayConfig, TracingConfig, parse_config
from pools.prefix_index import PrefixIndex
from pools.replicas import PoolRuntime, ScrapedLoad

MODEL = "MiniMaxAI/MiniMax-M3"
A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
CALLER = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "tracestate": "vendor=abc"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class StubGateway:
    config: GatewayConfig
    clock: Clock = field(default_factory=Clock)
    pools: dict[str, PoolRuntime] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pools = {p.name: PoolRuntime.from_config(p) for p in self.config.pools_by_size()}
        self.precise = PreciseRouting(PrefixIndex(), self.clock)  # no precise pools: its collector reports none


def make(tracing: dict[str, Any] | None = None, *, exporter: InMemorySpanExporter | None = None,
         env: Mapping[str, str] | None = None, metrics: bool = True) -> tuple[StubGateway, Telemetry]:
    text = f"""
model: {MODEL}
pools:
  - {{name: interactive, max_model_len: 32768, endpoints: ["{A}", "{B}"]}}
  - {{name: long, max_model_len: 131072, endpoints: ["http://10.0.1.1:8000/v1-prefix"]}}
"""
    config = parse_config(text, env={})
    config = config.model_copy(update={"telemetry": config.telemetry.model_copy(update={
        "metrics": metrics, "tracing": TracingConfig(**(tracing or {}))})})
    gw = StubGateway(config)
    return gw, Telemetry(gw, span_exporter=exporter, env=env or {})


def streamed_record(gw: StubGateway, telemetry: Telemetry, headers: Mapping[str, str]) -> tuple[RequestRecord,
                                                                                                  list[dict[str, str]]]:
    """A streamed chat request walked through the hooks with a controlled clock; returns it and the upstream headers."""
    clock = gw.clock
    record = RequestRecord(api="chat", stream=True, t_arrival=clock.now)
    record.path = "/v1/chat/completions"
    telemetry.start(record, headers)
    record.thinking_mode, record.prompt_tokens_est, record.max_tokens = "disabled", 900, 64
    record.first_pool, record.pool_reason = "interactive", "fits"
    record.t_classified = clock.now = 1000.002
    record.t_routed = clock.now = 1000.003
    record.pool, record.replica, record.reason, record.matched_blocks, record.attempts = \
        "interactive", A, "affinity_hit", 5, 1
    clock.now = 1000.004
    upstream: dict[str, str] = {"content-type": "application/json", **headers}
    telemetry.inject(record, upstream)
    record.t_sent = 1000.004
    record.t_headers = 1000.010
    record.status = 200
    record.t_first_byte = 1000.250
    record.t_last_byte = clock.now = 1001.250
    record.usage = {"prompt_tokens": 1000, "completion_tokens": 51, "prompt_tokens_details": {"cached_tokens": 640}}
    telemetry.finish(record)
    return record, [upstream]


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def test_streamed_request_span_tree_and_timings() -> None:
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    record, (upstream,) = streamed_record(gw, telemetry, CALLER)
    spans = by_name(exporter.get_finished_spans())
    # four spans; classification and the upstream call's headers are attributes (cheaper than spans)
    assert set(spans) == {"chat " + MODEL, "POST /v1/chat/completions", "m3gate.prefill", "m3gate.decode"}
    server, attempt = spans["chat " + MODEL], spans["POST /v1/chat/completions"]
    prefill, decode = spans["m3gate.prefill"], spans["m3gate.decode"]

    # the caller's trace continues: same trace id, the server span is the caller span's child
    assert server.kind is SpanKind.SERVER and attempt.kind is SpanKind.CLIENT
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {TRACE_ID}
    assert server.parent is not None and f"{server.parent.span_id:016x}" == CALLER_SPAN and server.parent.is_remote
    assert attempt.parent.span_id == server.context.span_id
    for child in (prefill, decode):
        assert child.parent.span_id == attempt.context.span_id

    # the replica is told the attempt span is its parent, and the caller's tracestate travels on
    assert upstream["traceparent"] == f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"
    assert upstream["tracestate"] == "vendor=abc"

    # timings: explicit, from the record's timestamps (ns, relative to the arrival)
    t0 = server.start_time

    def at(seconds: float) -> int:
        return t0 + round(seconds * 1e9)

    assert abs(server.end_time - at(1.250)) <= 1
    assert abs(attempt.start_time - at(0.004)) <= 1 and attempt.end_time == server.end_time
    assert prefill.start_time == attempt.start_time and abs(prefill.end_time - at(0.250)) <= 1  # first token
    assert decode.start_time == prefill.end_time and decode.end_time == server.end_time  # last token
    assert server.attributes["m3gate.classify_ms"] == pytest.approx(2.0)
    assert attempt.attributes["m3gate.upstream.headers_ms"] == pytest.approx(6.0)
    assert server.events == () and attempt.events == ()  # nothing waited, nothing was retried

    # attributes
    a = server.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 64
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (1000, 51)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 640
    assert a["m3gate.pool"] == "interactive" and a["m3gate.endpoint"] == A
    assert a["m3gate.class"] == "interactive"  # no traffic class yet: the pool names it
    assert a["m3gate.thinking_mode"] == "disabled" and a["m3gate.prefix.matched_blocks"] == 5
    assert a["m3gate.routing.reason"] == "affinity_hit"
    assert a["m3gate.gateway_overhead_ms"] == pytest.approx(4.0, abs=1e-3)
    assert a["http.response.status_code"] == 200 and server.status.status_code is StatusCode.UNSET
    assert decode.attributes["gen_ai.usage.output_tokens"] == 51
    assert decode.attributes["m3gate.tpot_ms"] == pytest.approx(1000 / 50)
    assert attempt.attributes["url.full"] == A + "/v1/chat/completions"


def test_retry_gives_a_failed_attempt_span_and_a_retry_event() -> None:
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    clock = gw.clock
    record = RequestRecord(api="completions", stream=False, t_arrival=clock.now)
    record.path = "/v1/completions"
    telemetry.start(record, {})
    record.t_classified = record.t_routed = clock.now = 1000.001
    sent_headers = []
    for attempt, (replica, t) in enumerate(((A, 1000.002), (B, 1000.050))):
        record.pool, record.replica, record.attempts, record.retried = "interactive", replica, attempt + 1, attempt > 0
        record.reason = "retry" if attempt else "least_loaded"
        clock.now = t
        headers: dict[str, str] = {}
        telemetry.inject(record, headers)
        sent_headers.append(headers["traceparent"])
        record.t_sent = t
    record.status, record.t_headers = 200, 1000.300
    record.t_first_byte = record.t_last_byte = clock.now = 1000.300
    telemetry.finish(record)

    spans = exporter.get_finished_spans()
    attempts = sorted((s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert [s.attributes["m3gate.endpoint"] for s in attempts] == [A, B]
    assert attempts[0].status.status_code is StatusCode.ERROR and attempts[0].end_time == attempts[1].start_time
    assert attempts[1].status.status_code is StatusCode.UNSET
    assert [f"{s.context.span_id:016x}" for s in attempts] == [h.split("-")[2] for h in sent_headers]
    assert [e.name for e in server.events] == ["m3gate.retry"]
    assert server.events[0].attributes["m3gate.endpoint"] == A
    assert server.attributes["m3gate.routing.reason"] == "retry" and server.attributes["m3gate.attempts"] == 2
    assert server.parent is None  # no incoming traceparent: a new trace
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert not any(s.name in ("m3gate.prefill", "m3gate.decode") for s in spans)  # not streamed: no split
    assert len(spans) == 3
    assert attempts[1].attributes["m3gate.upstream.headers_ms"] == pytest.approx(250.0)


def test_an_admission_wait_is_an_event_and_an_attribute() -> None:
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    record = RequestRecord(api="chat", stream=False, t_arrival=gw.clock.now)
    record.path = "/v1/chat/completions"
    telemetry.start(record, {})
    record.pool, record.replica, record.attempts, record.reason = "interactive", A, 1, "least_loaded"
    record.t_classified, record.t_routed, record.t_admitted = 1000.001, 1000.002, 1000.152  # 150 ms in the queue
    gw.clock.now = 1000.153
    telemetry.inject(record, {})
    record.t_sent, record.t_headers, record.status = 1000.153, 1000.2, 200
    record.t_first_byte = record.t_last_byte = gw.clock.now = 1000.3
    telemetry.finish(record)
    server = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert [e.name for e in server.events] == ["m3gate.admitted"]
    assert server.events[0].timestamp - server.start_time == pytest.approx(152e6, abs=2)
    assert server.attributes["m3gate.queue_wait_ms"] == pytest.approx(150.0)
    assert server.attributes["m3gate.gateway_overhead_ms"] == pytest.approx(3.0)  # the wait is not overhead


def test_unsampled_caller_propagates_without_recording() -> None:
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-00"}
    _, (upstream,) = streamed_record(gw, telemetry, headers)
    assert exporter.get_finished_spans() == ()
    assert upstream["traceparent"].startswith(f"00-{TRACE_ID}-") and upstream["traceparent"].endswith("-00")
    assert upstream["traceparent"].split("-")[2] != CALLER_SPAN


def test_sample_ratio_zero_drops_new_traces_but_follows_a_sampled_caller() -> None:
    exporter = InMemorySpanExporter()
    gw, telemetry = make({"sample_ratio": 0.0}, exporter=exporter)
    streamed_record(gw, telemetry, {})
    assert exporter.get_finished_spans() == ()
    streamed_record(gw, telemetry, CALLER)
    assert len(exporter.get_finished_spans()) == 4


def test_tracing_off_leaves_the_callers_headers_alone_and_builds_nothing() -> None:
    gw, telemetry = make()
    assert telemetry.tracing is None
    record, (upstream,) = streamed_record(gw, telemetry, CALLER)
    assert record.trace is None
    assert upstream["traceparent"] == CALLER["traceparent"]  # passed through as the client sent it
    assert telemetry.metrics is not None
    assert telemetry.metrics.registry.get_sample_value("m3gate_requests_total", {
        "api": "chat", "pool": "interactive", "class": "interactive", "thinking_mode": "disabled",
        "status": "200"}) == 1


def test_everything_off_makes_the_hooks_no_ops() -> None:
    gw, telemetry = make(metrics=False)
    assert telemetry.metrics is None and telemetry.tracing is None
    record, (upstream,) = streamed_record(gw, telemetry, {})
    assert record.trace is None and "traceparent" not in upstream


@pytest.mark.parametrize(("cfg", "env", "on"), [
    ({}, {}, False),
    ({}, {"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({}, {"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"enabled": False}, {"OTEL_TRACES_EXPORTER": "console"}, False),
    ({"enabled": True}, {}, True),
    ({"enabled": True}, {"OTEL_SDK_DISABLED": "true"}, False),
])
def test_tracing_switch_follows_config_then_otel_env(cfg: dict[str, Any], env: dict[str, str], on: bool) -> None:
    assert tracing_enabled(TracingConfig(**cfg), env) is on


def test_exporter_choice_and_otlp_endpoint() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    assert isinstance(build_exporter(TracingConfig(exporter="discard"), {}), DiscardingSpanExporter)
    assert isinstance(build_exporter(TracingConfig(), {"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    grpc = build_exporter(TracingConfig(endpoint="http://collector:4317"), {})
    assert isinstance(grpc, Grpc)
    grpc.shutdown()
    http = build_exporter(TracingConfig(protocol="http/protobuf", endpoint="http://collector:4318"), {})
    assert isinstance(http, Http) and http._endpoint == "http://collector:4318/v1/traces"
    env_http = build_exporter(TracingConfig(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert isinstance(env_http, Http)


def test_service_name_from_config_unless_otel_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _, telemetry = make({"service_name": "gw-eu"}, exporter=InMemorySpanExporter())
    assert telemetry.tracing is not None
    assert telemetry.tracing.provider.resource.attributes["service.name"] == "gw-eu"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    _, telemetry = make({"service_name": "gw-eu"}, exporter=InMemorySpanExporter(), env=dict(os.environ))
    assert telemetry.tracing is not None
    attributes = telemetry.tracing.provider.resource.attributes
    assert attributes["service.name"] == "from-env"
    assert attributes["deployment.environment"] == "staging"


# --------------------------------------------------------------------------------------------------------------
# metrics


def sample(telemetry: Telemetry, name: str, **labels: str) -> float | None:
    assert telemetry.metrics is not None
    return telemetry.metrics.registry.get_sample_value(name, labels)


def test_streamed_request_moves_latency_token_and_routing_metrics() -> None:
    gw, telemetry = make()
    streamed_record(gw, telemetry, {})
    cls = {"pool": "interactive", "class": "interactive"}
    req = {"api": "chat", **cls, "thinking_mode": "disabled"}
    assert sample(telemetry, "m3gate_time_to_first_token_seconds_count", **req) == 1
    assert sample(telemetry, "m3gate_time_to_first_token_seconds_sum", **req) == pytest.approx(0.250)
    assert sample(telemetry, "m3gate_time_to_first_token_seconds_bucket", **req, le="0.25") == 1
    assert sample(telemetry, "m3gate_time_to_first_token_seconds_bucket", **req, le="0.1") == 0
    assert sample(telemetry, "m3gate_prefill_seconds_sum", **cls) == pytest.approx(0.246)
    assert sample(telemetry, "m3gate_decode_seconds_sum", **cls) == pytest.approx(1.0)
    tpot = {"pool": "interactive", "class": "interactive", "thinking_mode": "disabled"}
    assert sample(telemetry, "m3gate_time_per_output_token_seconds_sum", **tpot) == pytest.approx(0.02)
    assert sample(telemetry, "m3gate_request_duration_seconds_sum", **req) == pytest.approx(1.25)
    assert sample(telemetry, "m3gate_gateway_overhead_seconds_sum", api="chat", **cls) == pytest.approx(0.004)
    assert sample(telemetry, "m3gate_gateway_queue_seconds_count", **cls) == 1
    assert sample(telemetry, "m3gate_prompt_tokens_total", **cls) == 1000
    assert sample(telemetry, "m3gate_output_tokens_total", **cls) == 51
    assert sample(telemetry, "m3gate_cached_prompt_tokens_total", **cls) == 640
    assert sample(telemetry, "m3gate_prompt_tokens_estimated_total", **cls) == 900
    assert sample(telemetry, "m3gate_prefix_matched_tokens_total", **cls) == 5 * 128
    assert sample(telemetry, "m3gate_routing_decisions_total", pool="interactive", reason="affinity_hit") == 1
    assert sample(telemetry, "m3gate_upstream_requests_total", pool="interactive", endpoint=A, status="200") == 1
    assert sample(telemetry, "m3gate_requests_in_flight", api="chat") == 0
    assert sample(telemetry, "m3gate_request_errors_total", api="chat", **cls, type="client_disconnected") is None


def test_in_flight_counts_between_start_and_finish() -> None:
    gw, telemetry = make()
    record = RequestRecord(api="messages", stream=False, t_arrival=gw.clock.now)
    telemetry.start(record, {})
    assert sample(telemetry, "m3gate_requests_in_flight", api="messages") == 1
    record.status, record.error = 400, "invalid_json"
    telemetry.finish(record)
    assert sample(telemetry, "m3gate_requests_in_flight", api="messages") == 0
    assert sample(telemetry, "m3gate_request_errors_total", api="messages", pool="none", **{"class": "none"},
                  type="invalid_json") == 1
    # a rejection never reached a replica: no latency or routing sample
    assert sample(telemetry, "m3gate_request_duration_seconds_count", api="messages", pool="none",
                  **{"class": "none"}, thinking_mode="none") is None


def test_client_gone_mid_stream_is_a_499_without_ttft() -> None:
    gw, telemetry = make()
    record = RequestRecord(api="chat", stream=True, t_arrival=gw.clock.now)
    telemetry.start(record, {})
    record.pool, record.replica, record.thinking_mode, record.reason = "interactive", A, "enabled", "least_loaded"
    record.t_classified = record.t_routed = record.t_sent = 1000.01
    record.status, record.t_first_byte, record.t_last_byte = 200, 1000.2, 1000.3
    record.client_disconnected = True
    telemetry.finish(record)
    labels = {"api": "chat", "pool": "interactive", "class": "interactive", "thinking_mode": "enabled"}
    assert sample(telemetry, "m3gate_requests_total", **labels, status="499") == 1
    assert sample(telemetry, "m3gate_request_errors_total", api="chat", pool="interactive", **{"class": "interactive"},
                  type="client_disconnected") == 1
    assert not sample(telemetry, "m3gate_time_to_first_token_seconds_count", **labels)  # absent or 0: no first token


def test_traffic_class_labels_when_set() -> None:
    gw, telemetry = make()
    record = RequestRecord(api="chat", stream=False, t_arrival=gw.clock.now, traffic_class="agent")
    telemetry.start(record, {})
    record.pool, record.replica, record.status, record.t_sent = "long", "http://10.0.1.1:8000/v1-prefix", 200, 1000.1
    record.first_pool, record.t_last_byte = "interactive", 1000.5
    telemetry.finish(record)
    assert sample(telemetry, "m3gate_requests_total", api="chat", pool="long", **{"class": "agent"},
                  thinking_mode="none", status="200") == 1
    assert sample(telemetry, "m3gate_routing_decisions_total", pool="long", reason="pool_spill") == 1


@pytest.mark.parametrize(("fields", "expected"), [
    ({"status": 200}, None),
    ({"status": 404, "error": "model_not_found"}, "model_not_found"),
    ({"status": 503, "error": "no_healthy_replica"}, "no_healthy_replica"),
    ({"status": 200, "error": "upstream stream ended without [DONE]"}, "stream_incomplete"),
    ({"status": 200, "error": "upstream failed mid-stream: ClientPayloadError"}, "stream_broken"),
    ({"status": 400}, "upstream_4xx"),
    ({"status": 500}, "upstream_5xx"),
    ({"status": 200, "client_disconnected": True}, "client_disconnected"),
    ({"status": 500, "error": "Some Free Text with spaces"}, "other"),
])
def test_error_types_are_a_fixed_vocabulary(fields: dict[str, Any], expected: str | None) -> None:
    record = RequestRecord(api="chat", stream=False, t_arrival=0.0)
    for key, value in fields.items():
        setattr(record, key, value)
    assert error_type(record) == expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({"reason": "affinity_hit"}, "affinity_hit"),
    ({"reason": "load_spill"}, "load_spill"),
    ({"reason": "retry", "retried": True}, "retry"),
    ({"reason": "least_loaded", "pool": "long", "first_pool": "interactive"}, "pool_spill"),
    ({"reason": "least_loaded", "pool": "long", "first_pool": "long", "pool_reason": "spill:interactive"},
     "pool_spill"),
    ({"reason": "something new"}, "other"),
])
def test_routing_reasons(fields: dict[str, Any], expected: str) -> None:
    record = RequestRecord(api="chat", stream=False, t_arrival=0.0, pool="interactive", first_pool="interactive")
    for key, value in fields.items():
        setattr(record, key, value)
    assert routing_reason(record) == expected


def test_replica_state_is_read_at_scrape_time() -> None:
    gw, telemetry = make()
    pool = gw.pools["interactive"]
    pool.replicas[A].scraped = ScrapedLoad(waiting=3, running=7, kv_usage=0.93, prefix_queries=1000, prefix_hits=640)
    pool.replicas[A].scraped_at = gw.clock.now - 1.5
    pool.replicas[B].record_failure(gw.clock.now)  # ejected for a second
    pe = {"pool": "interactive", "endpoint": A}
    assert sample(telemetry, "m3gate_replica_waiting_requests", **pe) == 3
    assert sample(telemetry, "m3gate_replica_kv_cache_usage_ratio", **pe) == 0.93
    assert sample(telemetry, "m3gate_replica_prefix_cache_hit_tokens_total", **pe) == 640
    assert sample(telemetry, "m3gate_replica_metrics_age_seconds", **pe) == pytest.approx(1.5)
    assert sample(telemetry, "m3gate_replica_waiting_requests", pool="interactive", endpoint=B) is None  # unscraped
    assert sample(telemetry, "m3gate_replica_available", pool="interactive", endpoint=B) == 0
    assert sample(telemetry, "m3gate_replica_ejections_total", pool="interactive", endpoint=B) == 1
    assert sample(telemetry, "m3gate_pool_available_replicas", pool="interactive") == 1
    assert sample(telemetry, "m3gate_pool_replicas", pool="interactive") == 2
    # the numbers follow the replicas, not a copy taken earlier
    pool.replicas[A].scraped = ScrapedLoad(waiting=0, running=1, kv_usage=0.1)
    assert sample(telemetry, "m3gate_replica_waiting_requests", **pe) == 0


def test_config_reloads_and_redis_gauge() -> None:
    gw, telemetry = make()
    assert sample(telemetry, "m3gate_config_reloads_total", result="failure") == 0  # exists before any reload
    telemetry.config_reloaded(True)
    telemetry.config_reloaded(False)
    telemetry.config_reloaded(True)
    assert sample(telemetry, "m3gate_config_reloads_total", result="success") == 2
    assert sample(telemetry, "m3gate_redis_up") is None  # no shared state configured: nothing to report
    gw.config = gw.config.model_copy(update={"state": "redis://127.0.0.1:6379/0"})
    telemetry.set_redis_up(False)
    assert sample(telemetry, "m3gate_redis_up") == 0
    telemetry.set_redis_up(True)
    assert sample(telemetry, "m3gate_redis_up") == 1


def test_scrape_targets_label_each_replica_with_its_pool() -> None:
    gw, _ = make()
    groups = scrape_targets(gw.pools)
    assert groups[0] == {"targets": ["10.0.0.1:8000"], "labels": {
        "pool": "interactive", "endpoint": A, "__scheme__": "http", "__metrics_path__": "/metrics"}}
    assert groups[-1]["labels"]["__metrics_path__"] == "/v1-prefix/metrics"
    assert len(groups) == 3


def test_a_telemetry_bug_never_fails_the_request(caplog: pytest.LogCaptureFixture) -> None:
    gw, telemetry = make(exporter=InMemorySpanExporter())
    record = RequestRecord(api="chat", stream=True, t_arrival=gw.clock.now)
    telemetry.start(record, {})
    record.pool, record.replica, record.t_sent, record.status = "interactive", A, 1000.1, 200
    record.t_admitted = "soon"  # type: ignore[assignment]  # a gateway bug: a stage time that is not a number
    telemetry.finish(record)  # must not raise
    assert "telemetry failed" in caplog.text


def test_nonsense_usage_counts_as_no_tokens() -> None:
    gw, telemetry = make()
    record = RequestRecord(api="chat", stream=False, t_arrival=gw.clock.now)
    telemetry.start(record, {})
    record.pool, record.replica, record.t_sent, record.status = "interactive", A, 1000.1, 200
    record.usage = {"prompt_tokens": "not a number", "completion_tokens": 3}  # a replica answering nonsense
    telemetry.finish(record)
    assert sample(telemetry, "m3gate_prompt_tokens_total", pool="interactive", **{"class": "interactive"}) == 0
    assert sample(telemetry, "m3gate_output_tokens_total", pool="interactive", **{"class": "interactive"}) == 3


def test_no_healthy_replica_is_counted_against_the_chosen_pool() -> None:
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    record = RequestRecord(api="chat", stream=False, t_arrival=gw.clock.now)
    telemetry.start(record, {})
    record.first_pool, record.pool_reason, record.thinking_mode = "long", "fits", "adaptive"
    record.t_classified = record.t_routed = 1000.001
    record.status, record.error = 503, "no_healthy_replica"
    telemetry.finish(record)
    assert sample(telemetry, "m3gate_requests_total", api="chat", pool="long", **{"class": "long"},
                  thinking_mode="adaptive", status="503") == 1
    assert sample(telemetry, "m3gate_request_errors_total", api="chat", pool="long", **{"class": "long"},
                  type="no_healthy_replica") == 1
    (server,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert server.attributes["m3gate.pool"] == "long" and "m3gate.endpoint" not in server.attributes
    assert server.status.status_code is StatusCode.ERROR and server.attributes["error.type"] == "no_healthy_replica"


def test_ttft_buckets_carry_the_trace_id_as_an_exemplar_for_prometheus() -> None:
    gw, telemetry = make(exporter=InMemorySpanExporter())
    streamed_record(gw, telemetry, CALLER)
    assert telemetry.metrics is not None
    body, content_type = telemetry.metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    exemplars = [line for line in body.decode().splitlines() if "# {" in line]
    assert len(exemplars) == 1 and exemplars[0].startswith("m3gate_time_to_first_token_seconds_bucket{")
    assert f'trace_id="{TRACE_ID}"' in exemplars[0]
    text, _ = telemetry.metrics.render("text/plain")
    assert b"# {" not in text  # the classic text format has no exemplars


def test_spans_reach_an_otlp_http_receiver_and_unsampled_requests_send_none() -> None:
    """The production path end to end: SpanBatcher's worker, the SDK's OTLP/HTTP exporter, protobuf over loopback to
    a receiver that decodes what a collector would; unsampled requests still pass their decision on (flags 00)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from loadtests.bench.telemetry import OtlpSink

    sink = OtlpSink(keep=True)
    otlp = {"enabled": True, "exporter": "otlp", "protocol": "http/protobuf", "endpoint": sink.url}
    try:
        gw, telemetry = make(otlp, env={"OTEL_BSP_SCHEDULE_DELAY": "60000"})
        sampled, _ = streamed_record(gw, telemetry, CALLER)
        gw_off, unsampled_telemetry = make({**otlp, "sample_ratio": 0.0})
        unsampled, (upstream,) = streamed_record(gw_off, unsampled_telemetry, {})
        assert telemetry.tracing is not None and unsampled_telemetry.tracing is not None
        telemetry.tracing.close()  # shutdown flushes the queue through the exporter
        unsampled_telemetry.tracing.close()
    finally:
        sink.close()
    received = [ExportTraceServiceRequest.FromString(body) for body in sink.bodies]
    spans = [span for request in received for rs in request.resource_spans for ss in rs.scope_spans
             for span in ss.spans]
    assert sorted(span.name for span in spans) == sorted(["chat " + MODEL, "POST /v1/chat/completions",
                                                          "m3gate.prefill", "m3gate.decode"])
    assert {span.trace_id.hex() for span in spans} == {TRACE_ID}
    resource = {kv.key: kv.value.string_value for kv in received[0].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "m3gate"
    server_span = next(span for span in spans if span.name == "chat " + MODEL)
    attributes = {kv.key: kv.value for kv in server_span.attributes}
    assert attributes["m3gate.pool"].string_value == "interactive"
    assert attributes["gen_ai.usage.output_tokens"].int_value == 51
    # the unsampled request exported nothing, yet told the replica not to sample either
    trace_id = f"{unsampled.trace.trace_id:032x}"
    assert upstream["traceparent"].startswith(f"00-{trace_id}-") and upstream["traceparent"].endswith("-00")
    assert unsampled_telemetry.tracing.in_flight == 0


@pytest.mark.parametrize(("ratio", "warned"), [(None, True), (1.0, True), (0.01, False)])
def test_sampling_every_request_for_export_is_warned_about(ratio: float | None, warned: bool,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from gateway.observability.telemetry import Tracing

    cfg = TracingConfig(enabled=True, exporter="otlp", protocol="http/protobuf", endpoint="http://127.0.0.1:9",
                        sample_ratio=ratio)
    with caplog.at_level("WARNING", logger="m3gate.telemetry"):
        tracing = Tracing.build(cfg, {}, lambda: MODEL, Clock())
    assert tracing is not None
    tracing.close()
    assert any("samples every request" in r.getMessage() for r in caplog.records) is warned


@pytest.mark.parametrize(("arg", "sampled"), [("0", False), ("1", True)])
def test_otel_traces_sampler_variables_decide_sampling_on_the_fast_path(arg: str, sampled: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    assert telemetry.tracing is not None and telemetry.tracing._bound is not None  # no sampler call per request
    record, (upstream,) = streamed_record(gw, telemetry, {})
    assert len(exporter.get_finished_spans()) == (4 if sampled else 0)
    assert upstream["traceparent"].endswith("-01" if sampled else "-00")
    record, _ = streamed_record(gw, telemetry, CALLER)  # a sampled caller is followed whatever the ratio
    assert len(exporter.get_finished_spans()) == (8 if sampled else 4)
