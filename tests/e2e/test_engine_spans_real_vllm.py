"""The engine stage split against a REAL vLLM CPU server exporting its own spans to the gateway.

One server of its own (the session's three do not trace): `--otlp-traces-endpoint http://127.0.0.1:<gateway>/v1/traces`
with `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`, as `m3gate pools render` writes it for a pool whose
`launch.otlp_traces_endpoint` is the gateway's receiver. The gateway (a real `m3gate serve` process) traces every
request it starts (sample_ratio 1.0) to a local OTLP sink, receives vLLM's spans, and forwards them there. Requests
whose caller sent an unsampled traceparent are not sampled by the gateway, nor by vLLM.

Asserted: the sink holds, for each sampled request, one trace with the gateway's spans and vLLM's `llm_request`
as the child of the gateway's attempt span; no llm_request for the unsampled ones; and m3gate_engine_*_seconds
count exactly the sampled requests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.bench.telemetry import OtlpSink
from pools.vllm_local.launcher import VllmServer, start_server

pytestmark = pytest.mark.vllm

MODEL = "MiniMaxAI/MiniMax-M3"
SAMPLED, UNSAMPLED = 3, 2


def spans_of(sink: OtlpSink) -> list[tuple[str, Span]]:
    """(service.name, span) of everything the sink received."""
    out = []
    for body in list(sink.bodies):
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            out.extend((service, span) for ss in rs.scope_spans for span in ss.spans)
    return out


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def gateway_config(endpoint: str, sink: OtlpSink) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 2048, "endpoints": [endpoint]}],
        "server": {"health_interval_s": 0.5},
        "telemetry": {"tracing": {"enabled": True, "exporter": "otlp", "protocol": "http/protobuf",
                                  "endpoint": sink.url, "sample_ratio": 1.0, "receive_engine_spans": True}},
    }


@pytest.fixture(scope="module")
def traced_stack(tiny_model_dir: Path) -> Iterator[tuple[GatewayProcess, VllmServer, OtlpSink]]:
    """The gateway first (so its port is taken before vLLM is told it), on a placeholder replica; then vLLM,
    exporting to the gateway; then the gateway's config names the real replica (hot reload)."""
    sink = OtlpSink(keep=True)
    gateway = start_gateway(gateway_config("http://127.0.0.1:9", sink), env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    server: VllmServer | None = None
    try:
        server = start_server(
            2048, model_dir=tiny_model_dir,
            extra_args=["--otlp-traces-endpoint", f"http://127.0.0.1:{gateway.port}/v1/traces"],
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm-interactive",
                 "OTEL_BSP_SCHEDULE_DELAY": "500"},
        )
        gateway.write_config(gateway_config(server.url, sink))
        deadline = time.monotonic() + 30
        while httpx.get(gateway.url + "/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, f"the reloaded pool never became ready:\n{gateway.log_tail()}"
            time.sleep(0.2)
        yield gateway, server, sink
    finally:
        gateway.stop()
        if server is not None:
            server.stop()
        sink.close()


def test_vllm_spans_join_the_gateway_trace_and_split_the_engine_stages(
    traced_stack: tuple[GatewayProcess, VllmServer, OtlpSink],
) -> None:
    gateway, server, sink = traced_stack
    unsampled_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        for i in range(SAMPLED + UNSAMPLED):
            headers = {"traceparent": f"00-{unsampled_trace}-00f067aa0ba902b{i}-00"} if i >= SAMPLED else {}
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello number {i}"}],
                    "max_tokens": 8, "stream": i % 2 == 0}
            answer = client.post("/v1/chat/completions", json=body, headers=headers)
            assert answer.status_code == 200, answer.text

        deadline = time.monotonic() + 90
        while True:
            spans = spans_of(sink)
            engine = [span for service, span in spans if span.name == "llm_request"]
            attempts = [span for service, span in spans if service == "m3gate" and span.kind == Span.SPAN_KIND_CLIENT]
            if (len(engine) >= SAMPLED and len(attempts) >= SAMPLED) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        metrics = client.get("/metrics").text

    tail = f"\ngateway log:\n{gateway.log_tail()}\nvLLM log:\n{server.log_tail(30)}"
    assert len(attempts) == SAMPLED, f"gateway attempt spans: {len(attempts)}{tail}"
    assert len(engine) == SAMPLED, f"llm_request spans: {len(engine)}{tail}"

    # one trace per sampled request: the gateway's server span, its attempt span, and vLLM's llm_request under it
    by_attempt = {(a.trace_id, a.span_id): a for a in attempts}
    services = {service for service, span in spans if span.name == "llm_request"}
    assert services == {"vllm-interactive"}
    for span in engine:
        attempt = by_attempt.get((span.trace_id, span.parent_span_id))
        assert attempt is not None, "llm_request is not the child of a gateway attempt span"
        attrs = {a.key: a.value for a in span.attributes}
        assert attrs["gen_ai.latency.time_in_model_prefill"].double_value > 0
        assert attrs["gen_ai.latency.time_in_model_decode"].double_value > 0
        server_spans = [s for service, s in spans if service == "m3gate" and s.kind == Span.SPAN_KIND_SERVER
                        and s.trace_id == span.trace_id]
        assert len(server_spans) == 1 and attempt.parent_span_id == server_spans[0].span_id
    assert len({span.trace_id for span in engine}) == SAMPLED
    assert all(span.trace_id.hex() != unsampled_trace for _, span in spans)  # unsampled: no span anywhere

    # the engine histograms count exactly the sampled requests, under the pool and class of the request
    key = (("class", "interactive"), ("pool", "interactive"))
    for stage in ("queue", "prefill", "decode"):
        counts = samples(metrics, f"m3gate_engine_{stage}_seconds_count")
        assert counts == {key: SAMPLED}, (stage, counts)
    assert samples(metrics, "m3gate_engine_prefill_seconds_sum")[key] > 0
    assert samples(metrics, "m3gate_engine_spans_total")[(("result", "joined"),)] == SAMPLED
    assert samples(metrics, "m3gate_engine_span_forwards_total")[(("result", "sent"),)] >= 1
    # every request (the unsampled too) still has the gateway's own combined stage
    assert samples(metrics, "m3gate_gateway_queue_seconds_count")[key] == SAMPLED + UNSAMPLED
