"""Telemetry across config reloads and topology changes, from crafted records (no network): a reload swaps the trace
pipeline while requests sampled by the old one are still exported by it; metrics turn off and on again; series of
pools and replicas that are gone leave /metrics; the inter-token latency histogram the relay feeds chunk by chunk."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import gateway.observability.telemetry as telemetry_module
from gateway.observability.metrics import ITL_BUCKETS, HistogramTable
from gateway.record import RequestRecord
from gateway.observability.telemetry import SpanBatcher, Telemetry
from policies.config import GatewayConfig, parse_config
from pools.replicas import PoolRuntime
from tests.unit.test_telemetry import A, B, CALLER, MODEL, StubGateway

LONG = "http://10.0.1.1:8000/v1-prefix"


def config(tracing: dict[str, Any] | None = None, metrics: bool = True, pools: str | None = None) -> GatewayConfig:
    text = f"""
model: {MODEL}
pools:
{pools or f'''  - {{name: interactive, max_model_len: 32768, endpoints: ["{A}", "{B}"]}}
  - {{name: long, max_model_len: 131072, endpoints: ["{LONG}"]}}'''}
telemetry:
  metrics: {str(metrics).lower()}
"""
    cfg = parse_config(text, env={})
    return cfg.model_copy(update={"telemetry": cfg.telemetry.model_copy(update={
        "tracing": cfg.telemetry.tracing.model_copy(update=tracing or {})})})


def reload(gw: StubGateway, telemetry: Telemetry, cfg: GatewayConfig) -> bool:
    """What Gateway.apply_config does for telemetry: the pools first, then the telemetry settings."""
    gw.config = cfg
    previous = gw.pools
    gw.pools = {p.name: PoolRuntime.from_config(p, previous.get(p.name)) for p in cfg.pools_by_size()}
    return telemetry.apply_config(cfg)


def begin(gw: StubGateway, telemetry: Telemetry, pool: str = "interactive", replica: str = A,
          headers: Mapping[str, str] | None = None, upstream: dict[str, str] | None = None) -> RequestRecord:
    """A streamed chat request up to its upstream call; `upstream` receives the headers its call would carry."""
    record = RequestRecord(api="chat", stream=True, t_arrival=gw.clock.now)
    record.path = "/v1/chat/completions"
    telemetry.start(record, headers or {})
    record.thinking_mode, record.first_pool, record.pool_reason = "disabled", pool, "fits"
    record.t_classified = record.t_routed = record.t_admitted = gw.clock.now + 0.001
    record.pool, record.replica, record.reason, record.attempts = pool, replica, "least_loaded", 1
    telemetry.inject(record, {} if upstream is None else upstream)
    record.t_sent = record.t_headers = gw.clock.now + 0.002
    return record


def end(gw: StubGateway, telemetry: Telemetry, record: RequestRecord) -> None:
    record.status, record.t_first_byte, record.t_last_byte = 200, gw.clock.now + 0.1, gw.clock.now + 0.5
    record.usage = {"prompt_tokens": 10, "completion_tokens": 5}
    telemetry.finish(record)


def sample(telemetry: Telemetry, name: str, **labels: str) -> float | None:
    assert telemetry.metrics is not None
    return telemetry.metrics.registry.get_sample_value(name, labels)


def series_labels(telemetry: Telemetry) -> set[tuple[str, str]]:
    """Every (label, value) of pool and endpoint in the exposition."""
    assert telemetry.metrics is not None
    return {(k, v) for family in telemetry.metrics.registry.collect() for s in family.samples
            for k, v in s.labels.items() if k in ("pool", "endpoint")}


@pytest.fixture
def exporters(monkeypatch: pytest.MonkeyPatch) -> list[InMemorySpanExporter]:
    """Each trace pipeline the telemetry builds exports to its own in-memory exporter, through the real batcher."""
    made: list[InMemorySpanExporter] = []

    def build_exporter(cfg: Any, env: Any) -> InMemorySpanExporter:
        made.append(InMemorySpanExporter())
        return made[-1]

    monkeypatch.setattr(telemetry_module, "build_exporter", build_exporter)
    return made


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_reload_swaps_the_trace_pipeline_and_the_old_one_exports_its_requests(
        exporters: list[InMemorySpanExporter]) -> None:
    env = {"OTEL_BSP_SCHEDULE_DELAY": "60000"}  # nothing is exported before a flush or a shutdown
    gw = StubGateway(config({"enabled": True, "exporter": "otlp", "sample_ratio": 1.0}))
    telemetry = Telemetry(gw, env=env)
    first = telemetry.tracing
    assert first is not None and len(exporters) == 1
    in_flight = begin(gw, telemetry)  # sampled by the first pipeline, still running during the reload

    assert not reload(gw, telemetry, config({"enabled": True, "exporter": "otlp", "sample_ratio": 0.0,
                                             "service_name": "gw-b"}))
    second = telemetry.tracing
    assert second is not None and second is not first and len(exporters) == 2
    assert first.retiring and not first.closed  # it waits for its request
    assert second.provider.resource.attributes["service.name"] == "gw-b"

    sent: dict[str, str] = {}
    unsampled = begin(gw, telemetry, upstream=sent)  # the new ratio applies to new requests
    assert sent["traceparent"].endswith("-00")
    followed = begin(gw, telemetry, headers=CALLER, upstream=sent)  # parent-based: a sampled caller is followed
    assert sent["traceparent"].endswith("-01")

    end(gw, telemetry, in_flight)  # its spans go out through the first pipeline, which then shuts down
    wait_for(lambda: first.closed and first.processor._thread.is_alive() is False)
    old = exporters[0].get_finished_spans()
    assert len(old) == 4 and {s.context.trace_id for s in old} == {in_flight.trace.trace_id}
    assert {s.resource.attributes["service.name"] for s in old} == {"m3gate"}

    end(gw, telemetry, unsampled)
    end(gw, telemetry, followed)
    second.processor.force_flush()
    new = exporters[1].get_finished_spans()
    assert {s.context.trace_id for s in new} == {followed.trace.trace_id}
    assert next(s for s in new if s.kind is SpanKind.SERVER).resource.attributes["service.name"] == "gw-b"

    assert not reload(gw, telemetry, config({"enabled": False}))  # tracing off: the pipeline shuts down at once
    assert telemetry.tracing is None
    wait_for(lambda: second.closed)
    sent: dict[str, str] = {}
    record = begin(gw, telemetry, upstream=sent)
    assert record.trace is None and "traceparent" not in sent
    end(gw, telemetry, record)
    assert sample(telemetry, "m3gate_requests_total", api="chat", pool="interactive", **{"class": "interactive"},
                  thinking_mode="disabled", status="200") == 4


def test_unchanged_tracing_settings_keep_the_pipeline(exporters: list[InMemorySpanExporter]) -> None:
    gw = StubGateway(config({"enabled": True, "exporter": "otlp"}))
    telemetry = Telemetry(gw, env={})
    tracing = telemetry.tracing
    assert not reload(gw, telemetry, config({"enabled": True, "exporter": "otlp"},
                                            pools=f'  - {{name: interactive, max_model_len: 32768, '
                                                  f'endpoints: ["{A}"]}}'))
    assert telemetry.tracing is tracing and len(exporters) == 1
    assert tracing is not None
    tracing.close()


def test_a_bad_tracing_setting_keeps_the_running_pipeline(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    gw = StubGateway(config({"enabled": True, "exporter": "discard"}))
    telemetry = Telemetry(gw, env={})
    tracing = telemetry.tracing

    def broken(cfg: Any, env: Any) -> Any:
        raise ValueError("no such collector")

    monkeypatch.setattr(telemetry_module, "build_exporter", broken)
    reload(gw, telemetry, config({"enabled": True, "exporter": "otlp", "endpoint": "http://nowhere:4317"}))
    assert telemetry.tracing is tracing and "the new tracing settings failed" in caplog.text
    assert tracing is not None
    tracing.close()


def test_metrics_turn_off_and_on_with_a_reload_and_count_on() -> None:
    gw = StubGateway(config())
    telemetry = Telemetry(gw, env={})
    registry = telemetry.metrics
    end(gw, telemetry, begin(gw, telemetry))
    running = begin(gw, telemetry)  # in flight across both reloads

    assert not reload(gw, telemetry, config(metrics=False))
    assert telemetry.metrics is None
    end(gw, telemetry, begin(gw, telemetry))  # started and ended while metrics were off: never counted
    late = begin(gw, telemetry)  # arrived while metrics were off, ends while they are on

    gw.clock.now += 1
    assert not reload(gw, telemetry, config(metrics=True))  # the same registry comes back: counters go on
    assert telemetry.metrics is registry
    assert sample(telemetry, "m3gate_requests_in_flight", api="chat") == 0  # restarted from zero
    fresh = begin(gw, telemetry)
    assert sample(telemetry, "m3gate_requests_in_flight", api="chat") == 1
    for record in (running, late, fresh):
        end(gw, telemetry, record)
    assert sample(telemetry, "m3gate_requests_in_flight", api="chat") == 0
    assert sample(telemetry, "m3gate_requests_total", api="chat", pool="interactive", **{"class": "interactive"},
                  thinking_mode="disabled", status="200") == 4  # all but the one that ended while off


def test_metrics_first_turned_on_by_a_reload_get_a_fresh_registry() -> None:
    gw = StubGateway(config(metrics=False))
    telemetry = Telemetry(gw, env={})
    assert telemetry.metrics is None and telemetry._off
    assert reload(gw, telemetry, config(metrics=True))  # True: the gateway registers its own collectors in it
    assert telemetry.metrics is not None and not telemetry._off
    end(gw, telemetry, begin(gw, telemetry))
    assert sample(telemetry, "m3gate_requests_in_flight", api="chat") == 0


def test_series_of_removed_pools_and_replicas_leave_the_exposition() -> None:
    gw = StubGateway(config())
    telemetry = Telemetry(gw, env={})
    for pool, replica in (("interactive", A), ("interactive", B), ("long", LONG)):
        record = begin(gw, telemetry, pool, replica)
        assert record.itl is not None
        record.itl.observe(0.02)
        end(gw, telemetry, record)
    rejected = RequestRecord(api="chat", stream=False, t_arrival=gw.clock.now)
    telemetry.start(rejected, {})
    rejected.status, rejected.error = 400, "invalid_json"
    telemetry.finish(rejected)
    before = series_labels(telemetry)
    assert {("pool", "long"), ("endpoint", B), ("endpoint", LONG), ("pool", "none")} <= before

    reload(gw, telemetry, config(pools=f'  - {{name: interactive, max_model_len: 32768, endpoints: ["{A}"]}}'))
    after = series_labels(telemetry)
    assert ("pool", "long") not in after and ("endpoint", B) not in after and ("endpoint", LONG) not in after
    assert {("pool", "interactive"), ("endpoint", A), ("pool", "none")} <= after  # the rest stays
    assert sample(telemetry, "m3gate_upstream_requests_total", pool="interactive", endpoint=A, status="200") == 1

    # a pool that comes back starts its series afresh, and requests on it are counted again
    reload(gw, telemetry, config())
    end(gw, telemetry, begin(gw, telemetry, "long", LONG))
    long_labels = {"api": "chat", "pool": "long", "class": "long", "thinking_mode": "disabled"}
    assert sample(telemetry, "m3gate_request_duration_seconds_count", **long_labels) == 1
    assert sample(telemetry, "m3gate_time_to_first_token_seconds_count", **long_labels) == 1
    assert sample(telemetry, "m3gate_upstream_requests_total", pool="long", endpoint=LONG, status="200") == 1

    # DNS discovery changes replicas without a reload: the next scrape drops the lost one
    gw.pools["interactive"].replicas.pop(A)
    assert ("endpoint", A) not in series_labels(telemetry)
    assert sample(telemetry, "m3gate_requests_total", api="chat", pool="interactive", **{"class": "interactive"},
                  thinking_mode="disabled", status="200") == 2  # pool series stay while the pool does


def test_inter_token_latency_is_fed_per_chunk_with_the_tpot_labels() -> None:
    gw = StubGateway(config())
    telemetry = Telemetry(gw, env={})
    record = begin(gw, telemetry)
    itl = record.itl
    assert itl is not None
    for gap in (0.004, 0.012, 0.012, 0.3):
        itl.observe(gap)
    end(gw, telemetry, record)
    labels = {"pool": "interactive", "class": "interactive", "thinking_mode": "disabled"}
    assert sample(telemetry, "m3gate_inter_token_latency_seconds_count", **labels) == 4
    assert sample(telemetry, "m3gate_inter_token_latency_seconds_sum", **labels) == pytest.approx(0.328)
    assert sample(telemetry, "m3gate_inter_token_latency_seconds_bucket", **labels, le="0.005") == 1
    assert sample(telemetry, "m3gate_inter_token_latency_seconds_bucket", **labels, le="0.025") == 3
    assert sample(telemetry, "m3gate_inter_token_latency_seconds_bucket", **labels, le="0.3") == 4
    assert sample(telemetry, "m3gate_time_per_output_token_seconds_count", **labels) == 1
    assert begin(gw, telemetry).itl.counts is itl.counts  # one series, shared by its streams
    plain = RequestRecord(api="chat", stream=False, t_arrival=gw.clock.now)
    telemetry.inject(plain, {})
    assert plain.itl is None  # only streams have inter-token gaps


def test_histogram_table_matches_prometheus_bucket_semantics() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    ours = HistogramTable(None, "x_seconds", "x", ("k",), ITL_BUCKETS)
    registry = CollectorRegistry()
    theirs = Histogram("x_seconds", "x", ["k"], buckets=ITL_BUCKETS, registry=registry)
    for value in (0.0, 0.001, 0.0010001, 0.01, 0.5, 80.0, 81.0, 1e9):
        ours.observe(("a",), value)
        theirs.labels("a").observe(value)
    (family,) = ours.collect()
    mine = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    reference = {(s.name, s.labels.get("le")): s.value for f in registry.collect() for s in f.samples
                 if not s.name.endswith("_created")}
    assert mine == reference


def test_span_batcher_builds_and_exports_in_batches_and_on_shutdown(exporters: list[InMemorySpanExporter]) -> None:
    env = {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8", "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_QUEUE_SIZE": "20"}
    gw = StubGateway(config({"enabled": True, "exporter": "otlp"}))
    telemetry = Telemetry(gw, env=env)
    tracing = telemetry.tracing
    assert tracing is not None and isinstance(tracing.processor, SpanBatcher)
    batcher, exported = tracing.processor, exporters[0]
    for _ in range(2):  # 2 requests x 4 spans: a full batch wakes the worker
        end(gw, telemetry, begin(gw, telemetry))
    wait_for(lambda: len(exported.get_finished_spans()) == 8)
    with batcher._export_lock:  # the worker cannot take any now: 7 requests into a queue of 20 // 4 = 5
        for _ in range(7):
            end(gw, telemetry, begin(gw, telemetry))
        assert batcher.dropped == 2 and len(batcher._queue) == 5
    tracing.close()  # exports what is left
    assert len(exported.get_finished_spans()) == 8 + 5 * 4
    traces = {s.context.trace_id for s in exported.get_finished_spans()}
    assert len(traces) == 7 and all(len([s for s in exported.get_finished_spans() if s.context.trace_id == t]) == 4
                                    for t in traces)


def test_snapshots_hold_no_object_the_garbage_collector_must_track() -> None:
    import gc

    gw = StubGateway(config({"enabled": True}))
    telemetry = Telemetry(gw, span_exporter=InMemorySpanExporter(), env={})
    assert telemetry.tracing is not None
    for headers in ({}, CALLER):  # a new trace, and a caller's (parent context and tracestate)
        record = begin(gw, telemetry, headers=headers)
        record.status, record.t_first_byte, record.t_last_byte = 200, gw.clock.now + 0.1, gw.clock.now + 0.5
        record.usage = {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
        snapshot = telemetry.tracing.snapshot(record, record.trace, gw.clock.now + 1)
        gc.collect()  # untracks tuples of untracked items
        assert [item for item in snapshot if gc.is_tracked(item)] == [] and not gc.is_tracked(snapshot)
        spans = telemetry.tracing.build_spans(snapshot)  # and the spans come out of it whole
        assert len(spans) == 4 and spans[-1].attributes["m3gate.pool"] == "interactive"
        if headers:
            assert spans[-1].parent is not None and spans[-1].parent.is_remote
            assert spans[-1].context.trace_state.to_header() == "vendor=abc"
