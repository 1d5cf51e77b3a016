"""The engine stage split: replicas' OTLP spans received on POST /v1/traces, joined to the gateway's sampled attempts,
counted in m3gate_engine_{queue,prefill,decode}_seconds, and forwarded unchanged to the gateway's collector.

A simulated replica does not trace, so the replica's export is built here by hand as vLLM builds it
(vllm/v1/engine/output_processor.py, `do_tracing`): an `llm_request` span whose parent is the attempt span named by
the traceparent the gateway sent, with vLLM's gen_ai.latency.* attributes. tests/e2e/test_engine_spans_real_vllm.py
does the same with real vLLM servers exporting on their own.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.observability.engine_spans import (
    ATTEMPT_TTL_S,
    MAX_ATTEMPTS,
    EngineSpans,
    Forwarder,
    extract,
)
from gateway.precise import PreciseRouting
from gateway.record import EngineSplit, RequestRecord
from loadtests.bench.telemetry import OtlpSink
from policies.config import GatewayConfig, TracingConfig
from pools.prefix_index import PrefixIndex
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
PROTOBUF = {"content-type": "application/x-protobuf"}


# ----------------------------------------------------------------------------------------------------------------
# helpers


def attribute(key: str, value: float | str) -> KeyValue:
    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(double_value=value))


def llm_request(trace_id: int, parent: int, queue: float, prefill: float, decode: float,
                name: str = "llm_request") -> Span:
    """An llm_request span shaped as vLLM 0.32's do_tracing makes it."""
    return Span(
        trace_id=trace_id.to_bytes(16, "big"), span_id=(parent ^ 0x5A5A).to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big"), name=name, kind=Span.SPAN_KIND_SERVER,
        start_time_unix_nano=time.time_ns() - 10**9, end_time_unix_nano=time.time_ns(),
        attributes=[attribute("gen_ai.latency.time_to_first_token", queue + prefill),
                    attribute("gen_ai.latency.time_in_queue", queue),
                    attribute("gen_ai.latency.time_in_model_prefill", prefill),
                    attribute("gen_ai.latency.time_in_model_decode", decode),
                    attribute("gen_ai.usage.prompt_tokens", 20), attribute("gen_ai.request.id", "chatcmpl-x")])


def export(*spans: Span) -> bytes:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": [attribute("service.name", "vllm-interactive")]},
        scope_spans=[ScopeSpans(scope={"name": "vllm.v1.engine.output_processor"}, spans=list(spans))])]
    ).SerializeToString()


def received_spans(bodies: list[bytes]) -> list[Span]:
    return [span for body in bodies for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans for span in ss.spans]


def histogram_counts(text: str, name: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(pool, class) → (count, sum) of a histogram in a /metrics text."""
    out: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            key = (sample.labels["pool"], sample.labels["class"])
            entry = out.setdefault(key, [0.0, 0.0])
            if sample.name == name + "_count":
                entry[0] = sample.value
            elif sample.name == name + "_sum":
                entry[1] = sample.value
    return {key: (v[0], v[1]) for key, v in out.items()}


def counter(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def config(endpoints: list[str], tracing: dict[str, Any], **extra: Any) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": endpoints}],
        "server": {"health_interval_s": 0.3},
        "admin": {"watch_config": False},
        "telemetry": {"tracing": tracing},
        **extra,
    })


def listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@asynccontextmanager
async def serving(cfg: GatewayConfig, sock: socket.socket | None = None) -> AsyncIterator[tuple[str, Any]]:
    """The gateway in this process on a free loopback port (uvicorn), with its lifespan."""
    app = build_app(cfg)
    sock = sock or listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "in-process gateway did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.gateway
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    replica = start_sim(8192, extra_args=["--speed", "50"])
    try:
        yield replica
    finally:
        replica.stop()


# ----------------------------------------------------------------------------------------------------------------
# the join alone


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, float | None, float | None, float | None]] = []

    def engine_stages(self, pool: str, klass: str, queue: float | None, prefill: float | None,
                      decode: float | None) -> None:
        self.seen.append((pool, klass, queue, prefill, decode))


def test_join_counts_each_remembered_attempt_once_and_only_in_its_trace() -> None:
    recorder = Recorder()
    now = [100.0]
    spans = EngineSpans(lambda: recorder, lambda: now[0])  # type: ignore[arg-type, return-value]
    spans.configure(TracingConfig(receive_engine_spans=True), True)
    record = RequestRecord(api="chat", stream=True, t_arrival=0.0)
    spans.remember(trace_id=7, span_id=0xA1, pool="interactive", klass="batch", record=record)
    spans.remember(trace_id=8, span_id=0xB2, pool="long", klass="long")
    body = export(llm_request(7, 0xA1, 0.01, 0.2, 1.5), llm_request(9, 0xB2, 0.0, 0.1, 0.1),  # wrong trace
                  llm_request(7, 0xC3, 0.0, 0.1, 0.1),  # unknown parent
                  llm_request(8, 0xB2, 0.0, 0.1, 0.1, name="engine_step"))  # not an llm_request
    _, timings, count = extract(body)
    assert count == 4 and len(timings) == 3
    assert spans.fold(timings, count) == 1
    assert recorder.seen == [("interactive", "batch", 0.01, 0.2, 1.5)]
    assert record.engine == EngineSplit(queue_s=0.01, prefill_s=0.2, decode_s=1.5)  # the status page's waterfall
    assert spans.spans == {"joined": 1, "unmatched": 2, "other": 1}
    assert spans.fold(timings, count) == 0  # delivered again: not counted twice
    assert spans.tracked == 1  # 0xB2 still waits for its own trace's span


def test_join_is_bounded_in_size_and_age() -> None:
    now = [0.0]
    spans = EngineSpans(lambda: None, lambda: now[0])
    spans.configure(TracingConfig(receive_engine_spans=True), True)
    for i in range(MAX_ATTEMPTS + 10):
        spans.remember(1, i + 1, "p", "p")
    assert spans.tracked == MAX_ATTEMPTS
    now[0] = ATTEMPT_TTL_S + 1
    spans.remember(1, 10**9, "p", "p")
    assert spans.tracked == 1
    spans.configure(TracingConfig(receive_engine_spans=False), False)  # off: nothing is kept
    assert spans.tracked == 0


# ----------------------------------------------------------------------------------------------------------------
# the whole path, over HTTP


@pytest.mark.asyncio
async def test_sampled_requests_get_the_engine_split_and_spans_reach_the_collector(
    sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    sink = OtlpSink(keep=True)
    tracing = {"enabled": True, "exporter": "otlp", "protocol": "http/protobuf", "endpoint": sink.url,
               "sample_ratio": 1.0, "receive_engine_spans": True, "engine_span_max_bytes": 64 * 1024}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}
    try:
        async with serving(config([sim.url], tracing)) as (url, gw), httpx.AsyncClient(timeout=30) as client:
            # 3 sampled requests (the ratio is 1), 2 whose caller said "not sampled" (flags 00)
            unsampled_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
            for i in range(5):
                headers = {"traceparent": f"00-{unsampled_trace}-00f067aa0ba902b{i}-00"} if i >= 3 else {}
                async with client.stream("POST", url + "/v1/chat/completions", json=chat, headers=headers) as r:
                    assert r.status_code == 200
                    await r.aread()
            await until(lambda: sum(1 for s in received_spans(sink.bodies) if s.kind == Span.SPAN_KIND_CLIENT) >= 3)
            attempts = [s for s in received_spans(sink.bodies) if s.kind == Span.SPAN_KIND_CLIENT]
            assert len(attempts) == 3 and gw.telemetry.engine_spans.tracked == 3

            # the replica's export, as vLLM sends it: one llm_request per sampled attempt, children of the attempt
            # spans; plus one under a span this gateway never sampled (the unsampled trace), and a gzip'd copy
            stages = [(0.01 * (i + 1), 0.1, 0.5) for i in range(3)]
            mine = [llm_request(int.from_bytes(a.trace_id, "big"), int.from_bytes(a.span_id, "big"), *stage)
                    for a, stage in zip(attempts, stages)]
            stranger = llm_request(int(unsampled_trace, 16), 0x00F067AA0BA902B3, 0.5, 0.5, 0.5)
            first, second = export(*mine[:2], stranger), export(mine[2])
            before = len(sink.bodies)
            answer = await client.post(url + "/v1/traces", content=first, headers=PROTOBUF)
            assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-protobuf"
            assert ExportTraceServiceResponse.FromString(answer.content) == ExportTraceServiceResponse()
            answer = await client.post(url + "/v1/traces", content=gzip.compress(second),
                                       headers={**PROTOBUF, "content-encoding": "gzip"})
            assert answer.status_code == 200
            # delivered twice (an exporter retry): counted once
            assert (await client.post(url + "/v1/traces", content=second, headers=PROTOBUF)).status_code == 200

            text = (await client.get(url + "/metrics")).text
            key = ("interactive", "interactive")
            for name, index in (("queue", 0), ("prefill", 1), ("decode", 2)):
                count, total = histogram_counts(text, f"m3gate_engine_{name}_seconds")[key]
                assert count == 3, name  # exactly the sampled requests
                assert total == pytest.approx(sum(stage[index] for stage in stages)), name
            assert counter(text, "m3gate_engine_spans_total", result="joined") == 3
            assert counter(text, "m3gate_engine_spans_total", result="unmatched") == 2  # the stranger, the repeat
            assert gw.telemetry.engine_spans.tracked == 0

            # forwarded unchanged (the gzip'd one inflated: the same protobuf bytes)
            await until(lambda: len(sink.bodies) >= before + 3)
            forwarded = sink.bodies[before:]
            assert first in forwarded and forwarded.count(second) == 2
            text = (await client.get(url + "/metrics")).text
            assert counter(text, "m3gate_engine_span_forwards_total", result="sent") == 3
            assert counter(text, "m3gate_engine_span_posts_total", status="200") == 3
    finally:
        sink.close()


@pytest.mark.asyncio
async def test_bad_bodies_and_strangers_are_refused() -> None:
    tracing = {"enabled": True, "exporter": "discard", "sample_ratio": 1.0, "receive_engine_spans": True,
               "engine_span_max_bytes": 1024, "engine_span_sources": ["192.168.7.0/24"]}
    app = build_app(config(["http://10.1.2.3:8000", "http://localhost:8001"], tracing))
    gw = app.state.gateway

    def client(host: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, client=(host, 40000))
        return httpx.AsyncClient(transport=transport, base_url="http://gw")

    good = export(llm_request(1, 2, 0.1, 0.1, 0.1))
    try:
        async with client("127.0.0.1") as local:
            post = local.post
            assert (await post("/v1/traces", content=good, headers=PROTOBUF)).status_code == 200
            assert (await post("/v1/traces", content=b"not protobuf", headers=PROTOBUF)).status_code == 400
            assert (await post("/v1/traces", content=b"{}", headers={"content-type": "application/json"})
                    ).status_code == 415
            assert (await post("/v1/traces", content=good, headers={**PROTOBUF, "content-encoding": "br"})
                    ).status_code == 415
            assert (await post("/v1/traces", content=b"x" * 2000, headers=PROTOBUF)).status_code == 413
            bomb = gzip.compress(b"\0" * 10_000)  # small on the wire, over the cap inflated
            assert len(bomb) < 1024
            assert (await post("/v1/traces", content=bomb, headers={**PROTOBUF, "content-encoding": "gzip"})
                    ).status_code == 413
            assert (await post("/v1/traces", content=b"\x1f\x8bnot gzip",
                               headers={**PROTOBUF, "content-encoding": "gzip"})).status_code == 400
            assert (await local.get("/v1/traces")).status_code in (404, 405)
        # the replicas (by their URLs' hosts) and the configured network may post; others may not
        for host, status in (("10.1.2.3", 200), ("192.168.7.9", 200), ("::1", 200), ("10.1.2.4", 403),
                             ("203.0.113.5", 403)):
            async with client(host) as peer:
                answer = await peer.post("/v1/traces", content=good, headers=PROTOBUF)
                assert answer.status_code == status, host
                if status == 403:  # a stranger is answered as any client of the gateway
                    assert answer.json()["error"]["code"] == "not_a_replica"
        assert gw.telemetry.engine_spans.posts == {"200": 4, "400": 2, "415": 2, "413": 2, "403": 2}
    finally:
        await gw.telemetry.shutdown()

    # off unless asked for, and unless tracing is on
    for tracing in ({"enabled": True, "exporter": "discard"}, {"enabled": False, "receive_engine_spans": True}):
        app = build_app(config(["http://10.1.2.3:8000"], tracing))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as local:
            answer = await local.post("/v1/traces", content=good, headers=PROTOBUF)
            assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
        await app.state.gateway.telemetry.shutdown()


def test_forwarding_over_grpc_sends_the_same_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a gRPC collector the decoded request goes through the SDK's gRPC exporter as it is."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from gateway.observability.telemetry import build_exporter

    got: list[ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
            got.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        exporter = build_exporter(TracingConfig(exporter="otlp", protocol="grpc",
                                                endpoint=f"http://127.0.0.1:{port}"), {})
        forwarder = Forwarder(exporter)
        assert forwarder.kind == "grpc"
        body = export(llm_request(3, 4, 0.1, 0.2, 0.3))
        request, _, _ = extract(body)
        assert forwarder.send(body, request)
        forwarder.close()
        assert forwarder.sent == 1 and got == [request]
        assert got[0].SerializeToString() == body
    finally:
        server.stop(0)


def test_a_full_forwarding_queue_drops_and_counts() -> None:
    class Slow:
        __module__ = "opentelemetry.exporter.otlp.proto.http.trace_exporter"

        class _client:
            @staticmethod
            def export(data: bytes) -> Any:
                time.sleep(0.2)
                return type("Result", (), {"success": True})()

        def shutdown(self) -> None:
            return None

    forwarder = Forwarder(Slow(), max_bytes=100)
    sent = [forwarder.send(b"x" * 60, ExportTraceServiceRequest()) for _ in range(4)]
    assert sent.count(False) >= 2 and forwarder.dropped == sent.count(False)
    forwarder.close()
    assert forwarder.sent == sent.count(True)


# ----------------------------------------------------------------------------------------------------------------
# the simulator traces as vLLM does


TRACING_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100",
               "OTEL_SERVICE_NAME": "vllm-sim-test"}


def test_the_simulator_exports_llm_request_spans_like_vllm() -> None:
    sink = OtlpSink(keep=True)
    sim = start_sim(8192, extra_args=["--speed", "50", "--otlp-traces-endpoint", sink.url + "/v1/traces"],
                    env=TRACING_ENV)
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
        trace = "0af7651916cd43dd8448eb211c80319c"
        for flags in ("01", "00", None):
            headers = {"traceparent": f"00-{trace}-b7ad6b71692033{flags}-{flags}"} if flags else {}
            assert httpx.post(sim.url + "/v1/chat/completions", json=chat, headers=headers, timeout=30
                              ).status_code == 200
        deadline = time.monotonic() + 10
        while len(received_spans(sink.bodies)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        spans = received_spans(sink.bodies)
    finally:
        sim.stop()
        sink.close()
    assert [s.name for s in spans] == ["llm_request", "llm_request"]  # the unsampled one made none
    child, root = spans
    assert child.trace_id.hex() == trace and child.parent_span_id.hex() == "b7ad6b7169203301"
    assert root.parent_span_id == b"" and root.trace_id.hex() != trace
    attrs = {a.key: a.value for a in child.attributes}
    queue, prefill, decode = (attrs[f"gen_ai.latency.{k}"].double_value
                              for k in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode"))
    assert queue >= 0 and prefill > 0 and decode > 0
    assert attrs["gen_ai.latency.e2e"].double_value >= queue + prefill + decode - 1e-6
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 5
    service = ExportTraceServiceRequest.FromString(sink.bodies[0]).resource_spans[0].resource.attributes[0]
    assert (service.key, service.value.string_value) == ("service.name", "vllm-sim-test")


def test_the_simulator_refuses_grpc_tracing() -> None:
    with pytest.raises(RuntimeError, match="OTLP/HTTP only"):
        start_sim(8192, extra_args=["--otlp-traces-endpoint", "http://127.0.0.1:4317"],
                  env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})


@pytest.mark.asyncio
async def test_a_tracing_simulator_behind_the_gateway_splits_the_engine_stages() -> None:
    """Sampled and unsampled requests through the gateway to a replica that traces: its spans come back to the
    gateway's receiver and only the sampled requests are counted."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    sim = start_sim(8192, extra_args=["--speed", "50", "--otlp-traces-endpoint",
                                      f"http://127.0.0.1:{port}/v1/traces"], env=TRACING_ENV)
    tracing = {"enabled": True, "exporter": "discard", "sample_ratio": 1.0, "receive_engine_spans": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    try:
        async with serving(config([sim.url], tracing), sock) as (url, gw), httpx.AsyncClient(timeout=30) as client:
            for i in range(6):
                headers = {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-00"} if i % 3 == 2 else {}  # 2 unsampled
                answer = await client.post(url + "/v1/chat/completions", json={**chat, "stream": i % 2 == 0},
                                           headers=headers)
                assert answer.status_code == 200
            engine = gw.telemetry.engine_spans
            await until(lambda: engine.spans["joined"] >= 4)
            await asyncio.sleep(0.3)  # nothing more arrives
            text = (await client.get(url + "/metrics")).text
    finally:
        sim.stop()
    assert engine.spans == {"joined": 4, "unmatched": 0, "other": 0} and engine.tracked == 0
    for stage in ("queue", "prefill", "decode"):
        (count, total), = histogram_counts(text, f"m3gate_engine_{stage}_seconds").values()
        assert count == 4 and total >= 0


def test_a_reload_turns_the_receiver_on_and_off_and_rebuilds_forwarding() -> None:
    from gateway.observability.telemetry import Telemetry

    sink = OtlpSink(keep=True)
    base = {"enabled": True, "exporter": "otlp", "protocol": "http/protobuf", "endpoint": sink.url}

    class Gw:
        clock = staticmethod(time.monotonic)

        def __init__(self, cfg: GatewayConfig) -> None:
            self.config = cfg
            self.pools: dict[str, Any] = {}
            self.precise = PreciseRouting(PrefixIndex(), time.monotonic)

    try:
        gw = Gw(config(["http://10.0.0.1:8000"], base))
        telemetry = Telemetry(gw, env={})
        engine = telemetry.engine_spans
        assert not engine.enabled and engine.forwarder is None
        telemetry.apply_config(config(["http://10.0.0.1:8000"], {**base, "receive_engine_spans": True}))
        assert engine.enabled and engine.forwarder is not None and engine.forwarder.kind == "http"
        first = engine.forwarder
        telemetry.apply_config(config(["http://10.0.0.1:8000"], {**base, "receive_engine_spans": True,
                                                                 "sample_ratio": 0.5}))
        assert engine.enabled and engine.forwarder is not None and engine.forwarder is not first
        telemetry.apply_config(config(["http://10.0.0.1:8000"], {**base, "enabled": False,
                                                                 "receive_engine_spans": True}))
        assert not engine.enabled and engine.forwarder is None  # tracing off: nothing to join, nowhere to forward
        telemetry.apply_config(config(["http://10.0.0.1:8000"], {**base, "receive_engine_spans": True}))
        assert engine.enabled
        # the receiver's counters are in the registry, and stay there when metrics go off and on again
        assert telemetry.metrics is not None
        body, _ = telemetry.metrics.render("text/plain")
        assert b"m3gate_engine_spans_total" in body and b"m3gate_engine_span_attempts_tracked" in body
        asyncio.run(telemetry.shutdown())
    finally:
        sink.close()
