"""The replicas' own spans: an OTLP/HTTP receiver that splits the replica's time into queue, prefill and decode.

vLLM started with `--otlp-traces-endpoint http://<gateway>/v1/traces` (and `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf`) exports one `llm_request` span per finished request, a child of the span named by the request's
`traceparent`: for a request the gateway sampled, its attempt span. That span carries vLLM's own timings
(`gen_ai.latency.time_in_queue`, `time_in_model_prefill`, `time_in_model_decode`). The gateway

- remembers each sampled attempt's span id with its pool and class (`EngineSpans.remember`, called by
  gateway/observability/telemetry.py's `inject`) in a bounded map: vLLM's batch processor exports seconds after the
  request ended, so the join waits for the span rather than the request;
- accepts `POST /v1/traces` (protobuf, gzip or not; 200 with an empty `ExportTraceServiceResponse` as a collector
  answers; 400 / 413 / 415 for what it cannot take), decodes it off the event loop, and folds each `llm_request` whose
  parent is a remembered attempt of the same trace into `m3gate_engine_{queue,prefill,decode}_seconds{pool,class}`,
  once (the entry is consumed); spans of unknown parents (unsampled elsewhere, expired, another gateway's) are
  counted and otherwise left alone;
- forwards every body unchanged to the collector the gateway's own tracing exports to, from a worker thread with a
  bounded queue (full: the body is dropped and counted), so the trace holds the gateway's spans and vLLM's together.
  OTLP/HTTP: the same protobuf bytes go through the SDK's HTTP client (its endpoint, headers, TLS, compression and
  retries). gRPC: the decoded request goes through the SDK's gRPC exporter as it is (no span is rebuilt).

Who may post: loopback, the replicas' own addresses (the hosts of the configured and discovered replica URLs, names
resolved at most every RESOLVE_S) and `telemetry.tracing.engine_span_sources` networks. No API key: replicas have
none. Off (404) unless `telemetry.tracing.receive_engine_spans` is set and tracing is on.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import error_response
from gateway.observability.metrics import RequestMetrics
from gateway.record import EngineSplit, RequestRecord
from policies.config import TracingConfig

log = logging.getLogger("m3gate.engine_spans")

ENGINE_SPAN = "llm_request"
QUEUE, PREFILL, DECODE = ("gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
                          "gen_ai.latency.time_in_model_decode")
PROTOBUF = "application/x-protobuf"
OK_BODY = ExportTraceServiceResponse().SerializeToString()  # b"": what a collector answers to a full success
MAX_ATTEMPTS = 65_536  # sampled attempts remembered at most (~150 B each); the oldest go first
ATTEMPT_TTL_S = 900.0  # an attempt's span may be joined this long after it was sent (long decodes, export delay)
FORWARD_QUEUE_BYTES = 32 * 1024 * 1024  # bodies waiting for the collector; beyond, new ones are dropped
RESOLVE_S = 30.0  # replica host names are resolved again at most this often

# (trace id, parent span id, queue s, prefill s, decode s) of one llm_request span
EngineTiming = tuple[int, int, float | None, float | None, float | None]


class BadBody(Exception):
    """The body is not an OTLP protobuf trace export (400)."""


def extract(body: bytes) -> tuple[ExportTraceServiceRequest, list[EngineTiming], int]:
    """Decode an export request (worker thread): the request, its llm_request spans' timings, its span count."""
    try:
        request = ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise BadBody(f"not an OTLP ExportTraceServiceRequest: {exc}") from None
    timings: list[EngineTiming] = []
    count = 0
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                count += 1
                if span.name != ENGINE_SPAN:
                    continue  # a parentless llm_request (no traceparent) stays in: parent 0, it joins nothing
                values: dict[str, float] = {}
                for attribute in span.attributes:
                    if attribute.key in (QUEUE, PREFILL, DECODE):
                        value = attribute.value
                        kind = value.WhichOneof("value")
                        if kind == "double_value":
                            values[attribute.key] = value.double_value
                        elif kind == "int_value":
                            values[attribute.key] = float(value.int_value)
                timings.append((int.from_bytes(span.trace_id, "big"), int.from_bytes(span.parent_span_id, "big"),
                                values.get(QUEUE), values.get(PREFILL), values.get(DECODE)))
    return request, timings, count


def _decode(body: bytes, gzipped: bool, limit: int) -> tuple[bytes, ExportTraceServiceRequest, list[EngineTiming],
                                                              int]:
    """Inflate (gzip) and decode a body, in a worker thread: the protobuf bytes and what `extract` returns."""
    if gzipped:
        body = gunzip(body, limit)
    return (body, *extract(body))


def gunzip(body: bytes, limit: int) -> bytes:
    """A gzip body inflated, refusing more than `limit` bytes out (a small bomb must not take the memory)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadBody(f"bad gzip body: {exc}") from None
    if len(out) > limit:
        raise OverflowError
    if not inflater.eof:
        raise BadBody("truncated gzip body")
    return out


# ----------------------------------------------------------------------------------------------------------------
# Forwarding to the gateway's collector


class Forwarder:
    """Sends received export requests to the collector, unchanged, from its own thread. `send` (event loop) only
    queues; a full queue drops the body (`dropped`). `sent` / `failed` are counted by the worker."""

    def __init__(self, exporter: Any, max_bytes: int = FORWARD_QUEUE_BYTES) -> None:
        self.exporter = exporter
        self.kind = forward_kind(exporter)
        self._queue: deque[tuple[bytes, ExportTraceServiceRequest]] = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.sent = self.failed = self.dropped = 0
        if self.kind == "grpc":  # the SDK's gRPC export path, fed an already encoded request
            exporter._translate_data = _as_is
            exporter._count_data = _span_count
        self._thread = threading.Thread(target=self._work, name="m3gate-engine-span-forward", daemon=True)
        self._thread.start()

    def send(self, raw: bytes, request: ExportTraceServiceRequest) -> bool:
        size = len(raw)
        with self._lock:
            if self._closed or self._bytes + size > self._max_bytes:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("engine span forwarding queue full (%d bytes): dropping", self._max_bytes)
                return False
            self._queue.append((raw, request))
            self._bytes += size
        self._wake.set()
        return True

    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    if not self._queue:
                        break
                    raw, request = self._queue.popleft()
                    self._bytes -= len(raw)
                ok = False
                try:
                    if self.kind == "http":
                        ok = bool(self.exporter._client.export(raw).success)
                    else:
                        ok = self.exporter._export(request).name == "SUCCESS"
                except Exception:  # a collector problem must not stop the worker
                    log.exception("forwarding engine spans failed")
                if ok:
                    self.sent += 1
                else:
                    self.failed += 1
            if self._closed:
                return

    def close(self) -> None:
        """Send what is queued, then shut the exporter down (blocking: call it off the event loop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._thread.join(30)
        try:
            self.exporter.shutdown()
        except Exception:
            log.exception("shutting the engine span exporter down failed")


def forward_kind(exporter: Any) -> str | None:
    """"http" or "grpc" for the SDK's OTLP exporters; None for anything else (console, discard: not forwarded)."""
    module = type(exporter).__module__
    if module.startswith("opentelemetry.exporter.otlp.proto.http") and hasattr(getattr(exporter, "_client", None),
                                                                              "export"):
        return "http"
    if module.startswith("opentelemetry.exporter.otlp.proto.grpc") and hasattr(exporter, "_export"):
        return "grpc"
    return None


def _as_is(request: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    return request


def _span_count(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


# ----------------------------------------------------------------------------------------------------------------
# The join


class EngineSpans:
    """Sampled attempts waiting for their replica's span, the receiver's state and counters (a Prometheus collector:
    `Telemetry` registers it with the metrics registry)."""

    def __init__(self, metrics: Callable[[], RequestMetrics | None], clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self.enabled = False
        self.max_bytes = 4 * 1024 * 1024
        self._sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
        # span id → (trace id, pool, class, the request's record, where the split is noted for the status page)
        self._attempts: dict[int, tuple[int, str, str, RequestRecord | None]] = {}
        self._order: deque[tuple[float, int]] = deque()  # (sent at, span id) of the last MAX_ATTEMPTS, oldest first
        self._resolved: dict[str, tuple[frozenset[str], float]] = {}  # replica host name → (addresses, when)
        self.forwarder: Forwarder | None = None
        self.spans = {"joined": 0, "unmatched": 0, "other": 0}
        self.posts: dict[str, int] = {}

    # configuration ---------------------------------------------------------------------------------------------
    def configure(self, cfg: TracingConfig, on: bool, exporter: Any = None) -> None:
        """Apply tracing settings (start, reload): on/off, sources, body cap, and where to forward (`exporter`: a
        fresh OTLP exporter of the gateway's own settings, owned from now on; None: forward nothing)."""
        self.enabled = on
        self.max_bytes = cfg.engine_span_max_bytes
        self._sources = tuple(ipaddress.ip_network(s, strict=False) for s in cfg.engine_span_sources)
        old, self.forwarder = self.forwarder, None
        if on and exporter is not None:
            if forward_kind(exporter) is not None:
                self.forwarder = Forwarder(exporter)
            else:
                exporter.shutdown()
        if not on:
            self._attempts.clear()
            self._order.clear()
        if old is not None:
            threading.Thread(target=old.close, name="m3gate-engine-span-forward-close", daemon=True).start()

    def close(self) -> None:
        """Blocking: flushes the forwarding queue (call it off the event loop)."""
        self.enabled = False
        forwarder, self.forwarder = self.forwarder, None
        if forwarder is not None:
            forwarder.close()

    # the join --------------------------------------------------------------------------------------------------
    def remember(self, trace_id: int, span_id: int, pool: str, klass: str,
                 record: RequestRecord | None = None) -> None:
        """A sampled attempt was sent (event loop): its replica's llm_request span will name it as parent. `record`
        gets the engine's split (`record.engine`) for the status page's waterfall."""
        now = self._clock()
        self._attempts[span_id] = (trace_id, pool, klass, record)
        order = self._order
        order.append((now, span_id))
        if len(order) > MAX_ATTEMPTS or now - order[0][0] > ATTEMPT_TTL_S:
            self._expire(now)

    def forget(self, span_id: int) -> None:
        self._attempts.pop(span_id, None)

    def _expire(self, now: float) -> None:
        """Forget the attempts beyond the last MAX_ATTEMPTS, and those older than ATTEMPT_TTL_S (O(1) each)."""
        attempts, order = self._attempts, self._order
        while order and (len(order) > MAX_ATTEMPTS or now - order[0][0] > ATTEMPT_TTL_S):
            attempts.pop(order.popleft()[1], None)

    def fold(self, timings: list[EngineTiming], spans: int) -> int:
        """Feed the histograms with the llm_request spans of remembered attempts (event loop); returns how many."""
        metrics = self._metrics()
        attempts = self._attempts
        joined = 0
        for trace_id, parent, queue, prefill, decode in timings:
            entry = attempts.get(parent)
            if entry is None or entry[0] != trace_id:
                continue
            del attempts[parent]  # one span per attempt: a duplicate delivery is not counted twice
            joined += 1
            if metrics is not None:
                metrics.engine_stages(entry[1], entry[2], queue, prefill, decode)
            if entry[3] is not None:
                entry[3].engine = EngineSplit(queue, prefill, decode)
        self.spans["joined"] += joined
        self.spans["unmatched"] += len(timings) - joined
        self.spans["other"] += spans - len(timings)
        return joined

    @property
    def tracked(self) -> int:
        return len(self._attempts)

    # who may post ----------------------------------------------------------------------------------------------
    async def allowed(self, host: str, replica_urls: Iterator[str]) -> bool:
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)
        if mapped is not None:
            address = mapped
        if address.is_loopback or any(address in net for net in self._sources):
            return True
        text = str(address)
        names: set[str] = set()
        for url in replica_urls:
            name = urlsplit(url).hostname or ""
            if name == text:
                return True
            try:
                ipaddress.ip_address(name)
            except ValueError:
                names.add(name)
        for name in names:
            if text in await self._resolve(name):
                return True
        return False

    async def _resolve(self, name: str) -> frozenset[str]:
        now = time.monotonic()
        cached = self._resolved.get(name)
        if cached is not None and now - cached[1] < RESOLVE_S:
            return cached[0]
        self._resolved[name] = (cached[0] if cached else frozenset(), now)  # one lookup at a time, failures cached
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM),
                                           2.0)
            addresses = frozenset(str(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])) for info in infos)
        except (TimeoutError, OSError, ValueError):
            return self._resolved[name][0]
        self._resolved[name] = (addresses, now)
        return addresses

    # metrics ---------------------------------------------------------------------------------------------------
    def count_post(self, status: int) -> None:
        key = str(status)
        self.posts[key] = self.posts.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        spans = CounterMetricFamily("m3gate_engine_spans", "Spans received from the replicas: joined (an "
                                    "llm_request under a sampled attempt, counted in m3gate_engine_*_seconds), "
                                    "unmatched (an llm_request of an attempt unknown here, or of none), other "
                                    "(other spans).",
                                    labels=["result"])
        for result, value in self.spans.items():
            spans.add_metric([result], float(value))
        posts = CounterMetricFamily("m3gate_engine_span_posts", "POST /v1/traces by answer (200, 400, 403, 404, "
                                    "413, 415).", labels=["status"])
        for status, value in list(self.posts.items()):
            posts.add_metric([status], float(value))
        forwards = CounterMetricFamily("m3gate_engine_span_forwards", "Received span batches forwarded to the "
                                       "gateway's collector: sent, failed, dropped (the queue was full).",
                                       labels=["result"])
        forwarder = self.forwarder
        for result in ("sent", "failed", "dropped"):
            forwards.add_metric([result], float(getattr(forwarder, result, 0) if forwarder is not None else 0))
        tracked = GaugeMetricFamily("m3gate_engine_span_attempts_tracked", "Sampled attempts waiting for their "
                                    "replica's llm_request span.", value=float(len(self._attempts)))
        yield from (spans, posts, forwards, tracked)


# ----------------------------------------------------------------------------------------------------------------
# HTTP


def _status(code: int, message: str, status: int) -> Response:
    """An OTLP error answer: a google.rpc.Status protobuf, as the OTLP/HTTP spec asks."""
    from google.rpc import status_pb2

    body = status_pb2.Status(code=code, message=message).SerializeToString()
    return Response(body, status, media_type=PROTOBUF)


async def receive(request: Request) -> Response:
    """POST /v1/traces: an OTLP/HTTP trace export from a replica."""
    gw = request.app.state.gateway
    engine: EngineSpans | None = getattr(gw.telemetry, "engine_spans", None)
    response = await _receive(request, gw, engine)
    if engine is not None:
        engine.count_post(response.status_code)
    return response


async def _receive(request: Request, gw: Any, engine: EngineSpans | None) -> Response:
    # off, or not a replica: answered as any other client of the gateway is (OpenAI-shaped errors); what follows
    # speaks to an OTLP exporter (google.rpc.Status bodies)
    if engine is None or not engine.enabled:
        return error_response(404, "POST /v1/traces: this gateway does not receive spans "
                              "(telemetry.tracing.receive_engine_spans)", "not_found_error", code=404)
    host = request.client.host if request.client else ""
    pools: Mapping[str, Any] = gw.pools
    if not await engine.allowed(host, (url for pool in list(pools.values()) for url in list(pool.replicas))):
        return error_response(403, "POST /v1/traces is open to the replicas only "
                              "(telemetry.tracing.engine_span_sources)", "permission_error", code="not_a_replica")
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in (PROTOBUF, "application/protobuf"):
        return _status(3, "only OTLP/HTTP protobuf is accepted (content-type application/x-protobuf)", 415)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", ""):
        return _status(3, f"content-encoding {encoding} is not supported (gzip is)", 415)
    limit = engine.max_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        return _status(8, f"body over {limit} bytes", 413)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return _status(8, f"body over {limit} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect:
        return Response(status_code=400)
    try:
        body, export, timings, count = await asyncio.to_thread(_decode, b"".join(chunks), encoding == "gzip", limit)
    except OverflowError:
        return _status(8, f"body over {limit} bytes once decompressed", 413)
    except BadBody as exc:
        return _status(3, str(exc), 400)
    engine.fold(timings, count)
    forwarder = engine.forwarder
    if forwarder is not None and count:
        forwarder.send(body, export)
    return Response(OK_BODY, 200, media_type=PROTOBUF)


def engine_span_routes() -> list[Route]:
    return [Route("/v1/traces", receive, methods=["POST"])]
