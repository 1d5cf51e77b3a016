"""vLLM's request tracing, simulated: `--otlp-traces-endpoint URL` makes the simulator export one `llm_request` span
per finished request, shaped as vLLM 0.32 builds it (vllm/v1/engine/output_processor.py, `do_tracing`): a SERVER span
from arrival to the end, child of the span in the request's `traceparent` (a parentless root without one, as vLLM's
parent-based sampler does; nothing when the traceparent says "not sampled"), carrying the engine's own timings
(`gen_ai.latency.time_in_queue`, `time_in_model_prefill`, `time_in_model_decode`, ...).

Spans are batched and POSTed over OTLP/HTTP protobuf every OTEL_BSP_SCHEDULE_DELAY ms (5000 by default, as vLLM's
batch processor). Only http/protobuf is spoken: like vLLM, the simulator needs
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for an HTTP endpoint (m3gate's /v1/traces receiver is one).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pools.sim.engine import SimRequest

log = logging.getLogger("m3gate.sim.tracing")

# the traceparent of the request being handled (set by the app's ASGI entry, read when the request is submitted)
TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("sim_traceparent", default=None)
NOT_SAMPLED = (0, 0)


def parse_traceparent(header: str | None) -> tuple[int, int] | None:
    """(trace id, parent span id) of a sampled W3C traceparent; None without one (a root span);
    NOT_SAMPLED when its flags say so (no span)."""
    if not header:
        return None
    parts = header.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return (trace_id, span_id) if flags & 1 else NOT_SAMPLED


def check_protocol(env: dict[str, str] | os._Environ[str]) -> str | None:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol != "http/protobuf":
        return (f"--otlp-traces-endpoint: the simulator exports OTLP/HTTP only; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is "
                f"{protocol!r}, set it to http/protobuf")
    return None


class SimTracer:
    """Collects finished requests' spans and exports them in batches from the event loop."""

    def __init__(self, endpoint: str, service_name: str | None = None, clock: Any = time.monotonic) -> None:
        self.endpoint = endpoint
        self.service_name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "vllm-sim"
        self.delay_s = max(0.01, int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")) / 1000)
        self.clock = clock
        self._pending: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._session: Any = None
        self._rng = random.Random()
        self.exported = self.failed = 0

    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-tracing")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._flush()
        if self._session is not None:
            await self._session.close()

    def finished(self, req: SimRequest) -> None:
        """A request left the engine (engine loop): its llm_request span, if its trace is sampled."""
        parent = req.trace_parent
        if parent == NOT_SAMPLED:
            return
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
        from opentelemetry.proto.trace.v1.trace_pb2 import Span

        end = req.finished_at if req.finished_at is not None else self.clock()
        wall = time.time_ns() - int((self.clock() - end) * 1e9)  # wall clock of `end`

        def ns(t: float) -> int:
            return wall - int((end - t) * 1e9)

        scheduled = req.scheduled_at if req.scheduled_at is not None else end
        first = req.first_token_at if req.first_token_at is not None else end
        last = req.last_token_at if req.last_token_at is not None else first
        values: dict[str, float | int | str] = {
            "gen_ai.latency.time_to_first_token": first - req.arrival,
            "gen_ai.latency.e2e": end - req.arrival,
            "gen_ai.latency.time_in_queue": scheduled - req.arrival,
            "gen_ai.usage.prompt_tokens": req.prompt_tokens,
            "gen_ai.usage.completion_tokens": req.num_output,
            "gen_ai.latency.time_in_model_prefill": first - scheduled,
            "gen_ai.latency.time_in_model_decode": last - first,
            "gen_ai.latency.time_in_model_inference": last - scheduled,
            "gen_ai.request.id": req.request_id,
            "gen_ai.request.max_tokens": req.max_tokens,
        }
        attributes = [KeyValue(key=k, value=AnyValue(string_value=v) if isinstance(v, str) else
                               AnyValue(int_value=v) if isinstance(v, int) else AnyValue(double_value=v))
                      for k, v in values.items()]
        trace_id, parent_id = parent if parent is not None else (self._rng.getrandbits(128) or 1, 0)
        self._pending.append(Span(
            trace_id=trace_id.to_bytes(16, "big"), span_id=(self._rng.getrandbits(64) or 1).to_bytes(8, "big"),
            parent_span_id=parent_id.to_bytes(8, "big") if parent_id else b"", name="llm_request",
            kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=ns(req.arrival), end_time_unix_nano=wall,
            attributes=attributes))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.delay_s)
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending or self._session is None:
            return
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans

        spans, self._pending = self._pending, []
        body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource={"attributes": [KeyValue(key="service.name", value=AnyValue(string_value=self.service_name))]},
            scope_spans=[ScopeSpans(scope={"name": "vllm.v1.engine.output_processor"}, spans=spans)])]
        ).SerializeToString()
        try:
            async with self._session.post(self.endpoint, data=body, timeout=10,
                                          headers={"content-type": "application/x-protobuf"}) as resp:
                await resp.read()
                ok = resp.status == 200
        except Exception:  # noqa: BLE001 - a collector away must not disturb the replica
            ok = False
        if ok:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
            log.warning("exporting %d spans to %s failed", len(spans), self.endpoint)
