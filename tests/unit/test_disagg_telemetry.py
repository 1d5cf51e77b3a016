"""A disaggregated request's trace: one CLIENT span per side (prefill, then decode), the decode side's KV transfer
and decode as its children; a failed prefill attempt is still a retried one."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.record import PDRecord, RequestRecord
from tests.unit.test_telemetry import A, B, make

P1, P2 = "http://10.0.9.1:8000", "http://10.0.9.2:8000"


def run(sides: list[tuple[str, str, float]]) -> list:
    exporter = InMemorySpanExporter()
    gw, telemetry = make(exporter=exporter)
    clock = gw.clock
    record = RequestRecord(api="chat", stream=True, t_arrival=clock.now)
    record.path = "/v1/chat/completions"
    telemetry.start(record, {})
    record.t_classified = record.t_routed = clock.now = 1000.001
    for i, (role, replica, t) in enumerate(sides):
        record.pool, record.replica, record.attempts = "interactive", replica, i + 1
        record.pd = PDRecord(role=role)
        clock.now = record.t_sent = t
        telemetry.inject(record, {})
    record.status, record.t_headers, record.t_first_byte = 200, sides[-1][2] + 0.01, sides[-1][2] + 0.2
    record.t_last_byte = clock.now = sides[-1][2] + 1.2
    record.usage = {"prompt_tokens": 9000, "completion_tokens": 11}
    telemetry.finish(record)
    return exporter.get_finished_spans()


def test_prefill_and_decode_sides() -> None:
    spans = run([("prefill", P1, 1000.002), ("decode", A, 1002.0)])
    clients = sorted((s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    assert [s.attributes["m3gate.pd.role"] for s in clients] == ["prefill", "decode"]
    prefill, decode = clients
    assert prefill.name == decode.name == "POST /v1/chat/completions"
    assert prefill.status.status_code is StatusCode.UNSET and prefill.end_time == decode.start_time
    assert (prefill.end_time - prefill.start_time) / 1e9 == pytest.approx(1.998, abs=1e-6)
    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == decode.context.span_id}
    assert set(children) == {"m3gate.kv_transfer", "m3gate.decode"}
    assert (children["m3gate.kv_transfer"].end_time - children["m3gate.kv_transfer"].start_time) / 1e9 == \
        pytest.approx(0.2, abs=1e-6)
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert not server.events  # nothing was retried


def test_a_failed_prefill_is_a_retried_attempt() -> None:
    spans = run([("prefill", P1, 1000.002), ("prefill", P2, 1000.5), ("decode", B, 1002.0)])
    clients = sorted((s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    assert [s.status.status_code for s in clients] == [StatusCode.ERROR, StatusCode.UNSET, StatusCode.UNSET]
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert [e.name for e in server.events] == ["m3gate.retry"]
