"""Traces and metrics of real requests over loopback HTTP.

A simulated replica sits behind two tiny recording proxies (the simulator does not show the headers it receives),
so the test sees exactly what a replica gets: the gateway's `traceparent`. The traced gateway runs in this process
(uvicorn on a free port) so its spans can go to an in-memory exporter; the metrics test runs the real `m3gate serve`
process and reads its /metrics with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
import pytest_asyncio
import uvicorn
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.cli.launcher import GatewayProcess, start_gateway
from gateway.observability.telemetry import Telemetry
from policies.config import GatewayConfig
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


class FailBudget:
    """How many generate requests the proxies answer with a 500 (shared, so "the first attempt" fails wherever)."""

    def __init__(self) -> None:
        self.remaining = 0


class RecordingProxy:
    """Forwards everything to the replica, streaming, and remembers the headers of each generate request."""

    def __init__(self, upstream: str, budget: FailBudget) -> None:
        self.upstream = upstream
        self.budget = budget
        self.seen: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(auto_decompress=False)

    async def stop(self) -> None:
        if self._session:
            await self._session.close()
        if self._runner:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        if request.path.startswith("/v1/"):
            self.seen.append({k.lower(): v for k, v in request.headers.items()})
            if self.budget.remaining > 0:
                self.budget.remaining -= 1
                return web.json_response({"error": {"message": "injected", "type": "InternalServerError",
                                                    "param": None, "code": 500}}, status=500)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() in ("content-type",)})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@asynccontextmanager
async def serving(config: GatewayConfig, exporter: InMemorySpanExporter | None) -> AsyncIterator[str]:
    """The gateway app in this process, on a free loopback port; its telemetry exports to `exporter` if given."""
    app = build_app(config)
    gateway = app.state.gateway
    gateway.telemetry = Telemetry(gateway, span_exporter=exporter, env={})
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "in-process gateway did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def gateway_config(endpoints: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": endpoints}],
        "server": {"health_interval_s": 0.3},
        "admin": {"watch_config": False},
        **extra,
    }


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    # slow prefill (5 ms per prompt token: ~100 ms here) and real-pace decode (12 ms per step), so both stages are
    # long enough to tell apart from the replica's response headers, which come at once
    replica = start_sim(8192, extra_args=["--prefill-us-per-token", "5000"])
    try:
        yield replica
    finally:
        replica.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def proxies(sim: SimProcess) -> AsyncIterator[tuple[list[RecordingProxy], FailBudget]]:
    budget = FailBudget()
    pair = [RecordingProxy(sim.url, budget), RecordingProxy(sim.url, budget)]
    for proxy in pair:
        await proxy.start()
    try:
        yield pair, budget
    finally:
        for proxy in pair:
            await proxy.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def traced(proxies: tuple[list[RecordingProxy], FailBudget]
                 ) -> AsyncIterator[tuple[str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    config = GatewayConfig.model_validate(gateway_config([p.url for p in proxies[0]]))
    async with serving(config, exporter) as url:
        yield url, exporter


async def stream_chat(url: str, headers: dict[str, str], max_tokens: int = 16) -> tuple[int, int, dict[str, Any]]:
    """A streamed chat request; returns (wall ns of the first event, of the last bytes, usage)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something about observability."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"thinking_mode": "disabled"}}
    first = last = 0
    usage: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for chunk in resp.aiter_bytes():
                first = first or time.time_ns()
                last = time.time_ns()
                for event in chunk.split(b"\n\n"):
                    if event.startswith(b"data: {") and b'"usage"' in event:
                        usage = orjson.loads(event[6:]).get("usage") or usage
    return first, last, usage


def tree_of(spans: tuple[ReadableSpan, ...], trace_id: int) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans if s.context.trace_id == trace_id}


async def eventually_spans(exporter: InMemorySpanExporter, trace_id: int, count: int) -> dict[str, ReadableSpan]:
    deadline = time.monotonic() + 5
    while True:
        spans = tree_of(exporter.get_finished_spans(), trace_id)
        if len(spans) >= count or time.monotonic() > deadline:
            return spans
        await asyncio.sleep(0.02)


@pytest.mark.asyncio(loop_scope="session")
async def test_streamed_request_trace_follows_the_stream_and_reaches_the_replica(
    traced: tuple[str, InMemorySpanExporter], proxies: tuple[list[RecordingProxy], FailBudget]
) -> None:
    url, exporter = traced
    first_ns, last_ns, usage = await stream_chat(url, {"traceparent": TRACEPARENT, "tracestate": "k=v"})
    spans = await eventually_spans(exporter, int(TRACE_ID, 16), 4)
    assert set(spans) == {f"chat {MODEL}", "POST /v1/chat/completions", "m3gate.prefill", "m3gate.decode"}
    server = spans[f"chat {MODEL}"]
    attempt = next(s for s in spans.values() if s.kind is SpanKind.CLIENT)
    prefill, decode = spans["m3gate.prefill"], spans["m3gate.decode"]

    # the caller's span is the parent; the replica was told the attempt span is its parent
    assert server.parent is not None and f"{server.parent.span_id:016x}" == CALLER_SPAN
    seen = [h for p in proxies[0] for h in p.seen if h.get("traceparent", "").split("-")[1:2] == [TRACE_ID]]
    assert len(seen) == 1
    assert seen[0]["traceparent"] == f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"
    assert seen[0]["tracestate"] == "k=v"
    assert attempt.attributes["m3gate.endpoint"] in {p.url for p in proxies[0]}

    # the stages follow the stream as the client saw it: prefill ends at the first event, decode at the last
    ms = 1_000_000
    assert server.start_time <= attempt.start_time == prefill.start_time < prefill.end_time == decode.start_time
    assert first_ns - 40 * ms <= prefill.end_time <= first_ns + 2 * ms
    assert last_ns - 40 * ms <= decode.end_time <= last_ns + 2 * ms
    assert prefill.end_time - prefill.start_time > 60 * ms  # ~20 prompt tokens at 5 ms
    assert decode.end_time - decode.start_time > 100 * ms  # 15 decode steps of ~12 ms
    # the replica answered with headers before its first token (connect + send + accepted)
    assert 0 < attempt.attributes["m3gate.upstream.headers_ms"] < (prefill.end_time - prefill.start_time) / ms - 40
    classify_ms = server.attributes["m3gate.classify_ms"]  # body read, classification, pool choice
    assert 0 < classify_ms <= (attempt.start_time - server.start_time) / ms

    # attributes match what the client was told
    a = server.attributes
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert a["gen_ai.request.max_tokens"] == 16 and a["gen_ai.operation.name"] == "chat"
    assert a["m3gate.pool"] == a["m3gate.class"] == "interactive" and a["m3gate.thinking_mode"] == "disabled"
    assert 0 < a["m3gate.gateway_overhead_ms"] < (attempt.start_time - server.start_time) / ms + 0.01
    tpot = decode.attributes["m3gate.tpot_ms"]
    assert tpot == pytest.approx((decode.end_time - decode.start_time) / ms / (usage["completion_tokens"] - 1),
                                 rel=0.01)


@pytest.mark.asyncio(loop_scope="session")
async def test_retried_request_shows_both_attempts(
    traced: tuple[str, InMemorySpanExporter], proxies: tuple[list[RecordingProxy], FailBudget]
) -> None:
    url, exporter = traced
    pair, budget = proxies
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    budget.remaining = 1
    await stream_chat(url, {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}, max_tokens=4)
    await eventually_spans(exporter, int(trace_id, 16), 4)
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == int(trace_id, 16)]
    attempts = sorted((s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert len(attempts) == 2
    assert attempts[0].status.status_code is StatusCode.ERROR and attempts[1].status.status_code is StatusCode.UNSET
    assert attempts[0].attributes["m3gate.endpoint"] != attempts[1].attributes["m3gate.endpoint"]
    assert [e.name for e in server.events] == ["m3gate.retry"]
    assert server.attributes["m3gate.routing.reason"] == "retry"
    got = sorted(h["traceparent"].split("-")[2] for p in pair for h in p.seen
                 if h.get("traceparent", "").split("-")[1:2] == [trace_id])
    assert got == sorted(f"{s.context.span_id:016x}" for s in attempts)  # each replica saw its own attempt span
    await asyncio.sleep(1.2)  # let the failed replica's ejection expire for the tests after this one


@pytest.mark.asyncio(loop_scope="session")
async def test_with_tracing_off_the_callers_traceparent_passes_through(
    proxies: tuple[list[RecordingProxy], FailBudget]
) -> None:
    config = GatewayConfig.model_validate(gateway_config([p.url for p in proxies[0]]))
    async with serving(config, None) as url:
        trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
        caller = f"00-{trace_id}-{CALLER_SPAN}-01"
        await stream_chat(url, {"traceparent": caller}, max_tokens=2)
        seen = [h for p in proxies[0] for h in p.seen if trace_id in h.get("traceparent", "")]
        assert [h["traceparent"] for h in seen] == [caller]


# --------------------------------------------------------------------------------------------------------------
# metrics through the real `m3gate serve` process


@pytest.fixture(scope="module")
def metrics_gateway(sim: SimProcess) -> Iterator[GatewayProcess]:
    gw = start_gateway(gateway_config([sim.url], telemetry={"metrics": True}))
    try:
        yield gw
    finally:
        gw.stop()


def scrape(gw: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_the_right_labels(metrics_gateway: GatewayProcess, sim: SimProcess) -> None:
    gw = metrics_gateway
    before = scrape(gw)
    client = httpx.Client(timeout=30)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "chat_template_kwargs": {"thinking_mode": "enabled"}}
    for _ in range(2):
        assert client.post(gw.base_url + "/chat/completions", json={**chat, "stream": True}).status_code == 200
    assert client.post(gw.base_url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
                       ).status_code == 200
    assert client.post(gw.base_url + "/chat/completions", json={**chat, "model": "nope"}).status_code == 404
    after = scrape(gw)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    chat_l = {"api": "chat", "pool": "interactive", "class": "interactive", "thinking_mode": "enabled"}
    assert moved("m3gate_requests_total", **chat_l, status="200") == 2
    assert moved("m3gate_time_to_first_token_seconds_count", **chat_l) == 2
    assert moved("m3gate_time_to_first_token_seconds_bucket", **chat_l, le="+Inf") == 2
    assert moved("m3gate_time_per_output_token_seconds_count", pool="interactive", **{"class": "interactive"},
                 thinking_mode="enabled") == 2
    assert moved("m3gate_decode_seconds_count", pool="interactive", **{"class": "interactive"}) == 2
    itl = {"pool": "interactive", "class": "interactive", "thinking_mode": "enabled"}  # one gap per relayed chunk
    assert moved("m3gate_inter_token_latency_seconds_count", **itl) >= 2 * 4
    assert 0 < moved("m3gate_inter_token_latency_seconds_sum", **itl) < moved("m3gate_decode_seconds_sum", **{
        "pool": "interactive", "class": "interactive"}) + 0.01
    assert moved("m3gate_output_tokens_total", pool="interactive", **{"class": "interactive"}) == 2 * 8 + 3
    assert moved("m3gate_request_duration_seconds_count", api="completions", pool="interactive",
                 **{"class": "interactive"}, thinking_mode="adaptive") == 1
    assert moved("m3gate_upstream_requests_total", pool="interactive", endpoint=sim.url, status="200") == 3
    assert moved("m3gate_request_errors_total", api="chat", pool="none", **{"class": "none"},
                 type="model_not_found") == 1
    assert moved("m3gate_gateway_overhead_seconds_count", api="chat", pool="interactive",
                 **{"class": "interactive"}) == 2
    assert value(after, "m3gate_requests_in_flight", api="chat") == 0
    # replica state, read at scrape time from the monitor's last poll
    replica = {"pool": "interactive", "endpoint": sim.url}
    assert value(after, "m3gate_replica_healthy", **replica) == 1
    assert value(after, "m3gate_pool_available_replicas", pool="interactive") == 1
    assert ("m3gate_replica_kv_cache_usage_ratio", tuple(sorted(replica.items()))) in after
    assert value(after, "m3gate_replica_prefix_cache_query_tokens_total", **replica) > 0
    assert value(after, "process_cpu_seconds_total") > 0
    # and Prometheus can discover the replica from the gateway, labelled with its pool
    targets = httpx.get(gw.url + "/metrics/targets").json()
    assert targets == [{"targets": [sim.url.removeprefix("http://")], "labels": {
        "pool": "interactive", "endpoint": sim.url, "__scheme__": "http", "__metrics_path__": "/metrics"}}]


def test_openmetrics_exposition_for_prometheus(metrics_gateway: GatewayProcess) -> None:
    resp = httpx.get(metrics_gateway.url + "/metrics",
                     headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    assert resp.text.rstrip().endswith("# EOF")
