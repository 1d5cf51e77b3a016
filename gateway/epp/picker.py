"""The endpoint picker: the gateway's decisions served to Envoy over ext_proc (the Gateway API Inference Extension's
endpoint-picker protocol; gateway/epp/wire.py builds its messages).

One coordinator, two front doors: `m3gate serve` relays each request itself; here Envoy relays it and asks, per
request, where it goes. The steps are the coordinator's own (gateway/coordinator.py): keys and input limits,
classify, choose a pool, admit (traffic classes, rate limits, queues), SLOs, choose replicas (prefix affinity,
precise routing), then `finished`. What differs is the door: the request arrives as ext_proc messages (headers, body
chunks), and the answer is a pick (a header and `envoy.lb` metadata listing the replica, then its fallback) or an
ImmediateResponse: an error in OpenAI's shape with the status `serve` gives, or what the gateway's own app answers for
paths that need no replica (/v1/models, /tokenize, /health, ...).

With `response_processing="full"` Envoy streams the answer through the picker too, which is how the picker learns
what `serve` learns from relaying: the status, the first token's time and the gaps between tokens (the latency
model), usage (token estimates), sessions' tool calls, and the metrics. It also drops the usage chunk the picker
asked vLLM for. With "none" Envoy sends the request only: each request costs one round trip, and the picker learns
when the request ended (Envoy closes the stream then) but not how.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from starlette.requests import Request
from starlette.types import ASGIApp, Message

from gateway.epp import wire
from gateway.coordinator import Coordinator
from gateway.errors import QUEUE_MS_HEADER, UpstreamFailure, error_body, queue_ms, refusal_headers
from gateway.record import RequestRecord
from gateway.relay import SseFilter
from gateway.routes import GENERATE_PATHS
from gateway.upstream import Target, blame_answered_5xx
from policies.classify import RequestProfile
from policies.errors import RequestRejected
from policies.replica_choice import RoutingRequest
from policies.vllm_wire import usage_of
from pools.replicas import LoadGuard

log = logging.getLogger("m3gate.epp")

RESPONSE_MODES = ("full", "none")
# The client's credentials are the gateway's business, never a replica's (as gateway/relay.py's NOT_FORWARDED).
_CREDENTIALS = ("authorization", "x-api-key", "cookie")
SERVER_ERROR = "The gateway failed on this request; it has been logged."


class EndpointPicker(ext_grpc.ExternalProcessorServicer):
    """Envoy's ext_proc service: one `Exchange` per HTTP request."""

    def __init__(self, coordinator: Coordinator, app: ASGIApp, response_processing: str = "full") -> None:
        if response_processing not in RESPONSE_MODES:
            raise ValueError(f"response_processing must be one of {RESPONSE_MODES}")
        self.coordinator = coordinator
        self.gw = coordinator.gw
        self.app = app  # the gateway's own ASGI app: answers the paths that need no replica
        self.full = response_processing == "full"
        self.addresses = Addresses()
        self.served_elsewhere = 0  # requests Envoy sent to a fallback (the pick was unreachable)

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802 - the gRPC method's name
        exchange = Exchange(self, context)
        await exchange.run(request_iterator)


class Exchange:
    """One HTTP request's ext_proc stream: the request's headers and body in, a pick or an answer out; then, in full
    mode, the response passing through."""

    def __init__(self, picker: EndpointPicker, context: Any) -> None:
        self.picker = picker
        self.context = context
        self.gone = asyncio.Event()  # Envoy closed the stream: the request is over, or its client left
        self.request: Request | None = None
        self.subset: list[str] | None = None  # Envoy's subset hint: the endpoints this request may go to
        self.record: RequestRecord | None = None
        self.client: Any = None
        self.api = ""
        self.chunks: list[bytes] = []
        self.size = 0
        self.answered = False  # an ImmediateResponse went out: nothing more to do but wait for the end
        self.targets: list[Target] = []
        self.guard: LoadGuard | None = None
        self.profile: RequestProfile | None = None
        self.filter: SseFilter | None = None
        self.response: list[bytes] = []  # a complete (non-streamed) answer, read for usage and tool calls
        self.last = 0.0

    async def run(self, request_iterator: Any) -> None:
        queue: asyncio.Queue[ext.ProcessingRequest | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    queue.put_nowait(message)
            finally:
                self.gone.set()
                queue.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (message := await queue.get()) is not None:
                await self.handle(message)
        finally:
            reader.cancel()
            await self.close()

    async def handle(self, message: ext.ProcessingRequest) -> None:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            await self.on_request_headers(message)
        elif kind == "request_body":
            await self.on_request_body(message)
        elif kind == "request_trailers":
            if not self.answered:
                await self.context.write(wire.trailers_reply(request=True))
        elif kind == "response_headers":
            await self.on_response_headers(message)
        elif kind == "response_body":
            await self.on_response_body(message.response_body)
        elif kind == "response_trailers":
            await self.context.write(wire.trailers_reply(request=False))

    # the request -----------------------------------------------------------------------------------------------
    async def on_request_headers(self, message: ext.ProcessingRequest) -> None:
        self.request = request = self._asgi_request(message)
        self.subset = wire.endpoint_list(wire.metadata_value(message, wire.SUBSET_NAMESPACE, wire.SUBSET_KEY))
        self.api = GENERATE_PATHS.get(request.scope["path"], "") if request.scope["method"] == "POST" else ""
        declared = request.headers.get("content-length", "")
        if not self.api:
            if declared.isdigit() and await self._over_limit(int(declared)):
                return
            if message.request_headers.end_of_stream:
                await self.answer_locally()
            return
        gw = self.picker.gw
        self.record = record = RequestRecord(api=self.api, stream=False, t_arrival=gw.clock())
        record.path = request.scope["path"]
        gw.telemetry.start(record, request.headers)
        try:
            self.client = gw.traffic.authenticate(request)  # no key, no body read
        except RequestRejected as exc:
            await self.refuse(exc)
            return
        if declared.isdigit() and await self._over_limit(int(declared)):
            return
        if message.request_headers.end_of_stream:
            await self.decide()

    def _asgi_request(self, message: ext.ProcessingRequest) -> Request:
        """The request as the gateway's steps read it: an ASGI scope from the ext_proc headers, and a `receive`
        that says the client left once Envoy closes the stream."""
        pairs = wire.header_pairs(message.request_headers)
        pseudo = {k.decode("latin-1"): v.decode("latin-1") for k, v in pairs if k.startswith(b":")}
        headers = [(k, v) for k, v in pairs if not k.startswith(b":")]
        if ":authority" in pseudo and not any(k == b"host" for k, _ in headers):
            headers.append((b"host", pseudo[":authority"].encode("latin-1")))
        path, _, query = pseudo.get(":path", "/").partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": pseudo.get(":method", "GET"), "scheme": pseudo.get(":scheme", "http"), "path": path,
                 "raw_path": path.encode("latin-1"), "query_string": query.encode("latin-1"), "root_path": "",
                 "headers": headers, "client": None, "server": None, "state": {}}
        gone = self.gone

        async def receive() -> Message:
            await gone.wait()
            return {"type": "http.disconnect"}

        return Request(scope, receive)

    async def on_request_body(self, message: ext.ProcessingRequest) -> None:
        if self.answered or self.request is None:
            return
        body = message.request_body
        self.chunks.append(body.body)
        self.size += len(body.body)
        if await self._over_limit(self.size):
            return
        if body.end_of_stream:
            if self.api:
                await self.decide()
            else:
                await self.answer_locally()

    async def _over_limit(self, size: int) -> bool:
        """A body (declared, or read so far) past `server.max_body_bytes` is refused with a 413, whatever the path:
        the picker holds every body it answers itself in memory until it ends, as it does a generate path's."""
        limit = self.picker.gw.config.server.max_body_bytes
        if size <= limit:
            return False
        self.chunks = []
        await self.refuse(RequestRejected(f"Request body is {size} bytes or more; this gateway accepts at most "
                                          f"{limit} bytes. Send a smaller request.", status=413,
                                          code="request_too_large"))
        return True

    async def answer_locally(self) -> None:
        """A path that needs no replica's answer: the gateway's own app answers it, as an ImmediateResponse."""
        assert self.request is not None
        body = b"".join(self.chunks)
        sent: list[Message] = []
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        await self.picker.app(dict(self.request.scope), receive, send)
        start = next((m for m in sent if m["type"] == "http.response.start"), None)
        status = start["status"] if start else 500
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in (start or {}).get("headers", [])
                   if k.lower() not in (b"content-length", b"transfer-encoding", b"connection")}
        payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        self.answered = True
        await self.context.write(wire.immediate(status, payload, headers))

    async def decide(self) -> None:
        """The coordinator's steps, then the pick; every refusal is an ImmediateResponse in OpenAI's shape."""
        record, request = self.record, self.request
        assert record is not None and request is not None
        try:
            payload, destinations, set_headers = await self._choose(request, record, b"".join(self.chunks))
        except RequestRejected as exc:
            await self.refuse(exc)
            return
        except UpstreamFailure as exc:
            record.status, record.error = exc.status, exc.code
            type_ = "timeout_error" if exc.status == 504 else "upstream_error"
            headers = self.picker.gw.traffic.response_headers(record)
            if exc.status == 503:
                headers["retry-after"] = "1"
            await self.immediate(exc.status, error_body(exc.message, type_, None, exc.code), headers, exc.code)
            return
        except Exception:  # a gateway bug: logged, answered and counted as `serve` answers its own (gateway/routes.py)
            log.exception("unexpected error picking a replica for POST %s", record.path)
            record.status, record.error = 500, "server_error"
            await self.immediate(500, error_body(SERVER_ERROR, "server_error"), {})
            return
        self.chunks = []
        remove = [name for name in _CREDENTIALS if name not in set_headers and _has(request, name)]
        remove += [k.decode("latin-1") for k, _ in request.scope["headers"] if k.startswith(b"x-m3gate-")]
        await self.context.write(wire.request_headers_reply(destinations, set_headers, remove))
        for reply in wire.body_replies(payload, request=True):
            await self.context.write(reply)

    async def _choose(self, request: Request, record: RequestRecord, raw: bytes
                      ) -> tuple[bytes, list[str], dict[str, str]]:
        """`Coordinator.prepare`'s decisions, then the pick; returns the body to send, the `ip:port` list and the
        headers to set."""
        coordinator = self.picker.coordinator
        ready = await coordinator.prepare(request, record, self.client, raw, self.api, usage=self.picker.full,
                                          resumable=False)
        profile, routing = ready.profile, ready.routing
        targets, routings = await coordinator.pick(record, ready.choice, routing, ready.payload)
        targets = await self._within_subset(targets)
        self.profile, self.targets = profile, targets
        self.filter = SseFilter(ready.strip_usage) if profile.stream else None
        return ready.payload, [await self.picker.addresses.of(t.replica.url) for t in targets], \
            self._dispatch(targets[0], routings.get(targets[0].pool.name, routing), routing)

    async def _within_subset(self, targets: list[Target]) -> list[Target]:
        """The targets Envoy's subset hint allows (none left: 503, as the protocol says)."""
        if self.subset is None:
            return targets
        allowed = set(self.subset)
        kept = [t for t in targets if await self.picker.addresses.of(t.replica.url) in allowed]
        if kept:
            return kept
        kept = await self._subset_replicas(allowed)
        if not kept:
            raise UpstreamFailure(503, "None of the endpoints in the request's subset hint can serve it.",
                                  "no_eligible_endpoint")
        return kept

    async def _subset_replicas(self, allowed: set[str]) -> list[Target]:
        """When the routed choice lies outside the hint: the hint's available replicas in the chosen pool's
        candidates, least loaded first."""
        gw = self.picker.gw
        now = gw.clock()
        record = self.record
        assert record is not None
        found: list[Target] = []
        for name in [record.first_pool, *gw.pools]:
            pool = gw.pools.get(name)
            if pool is None or pool.config.max_model_len < self._needed():
                continue
            for replica in sorted(pool.replicas.values(), key=lambda r: r.in_flight):
                if replica.is_available(now) and await self.picker.addresses.of(replica.url) in allowed:
                    found.append(Target(pool, replica, "subset_hint", 0))
            if found:
                break
        return found[:2]

    def _needed(self) -> int:
        profile = self.profile
        return 0 if profile is None else profile.prompt_tokens

    def _dispatch(self, target: Target, dispatched_as: RoutingRequest, routing: RoutingRequest) -> dict[str, str]:
        """`Upstream.dispatch` for the pick (the replica's in-flight count held until the stream ends); returns the
        headers the replica gets (traceparent, pool key)."""
        record, profile = self.record, self.profile
        assert record is not None and profile is not None
        headers: dict[str, str] = {}
        self.guard = self.picker.coordinator.upstream.dispatch(record, profile, target, routing, headers,
                                                               dispatched_as=dispatched_as)
        return headers

    async def refuse(self, exc: RequestRejected) -> None:
        record = self.record
        headers = self.picker.gw.traffic.refusal_headers(record, exc) if record is not None else {}
        if record is not None:
            record.status, record.error = exc.status, exc.code or exc.type
        await self.immediate(exc.status, error_body(exc.message, exc.type, exc.param, exc.code), headers, exc.code)

    async def immediate(self, status: int, body: bytes, headers: dict[str, str], code: str | None = None) -> None:
        """The gateway's own answer in OpenAI's shape; `code`: the body's, repeated in x-m3gate-refusal."""
        self.answered = True
        if status == 499 or self.gone.is_set():
            return  # the client is gone: nobody to answer
        await self.context.write(wire.immediate(status, body, {"content-type": "application/json",
                                                               **refusal_headers(code, headers)}))

    # the response (full mode) ----------------------------------------------------------------------------------
    async def on_response_headers(self, message: ext.ProcessingRequest) -> None:
        record = self.record
        extra: dict[str, str] = {}
        if record is not None and not self.answered:
            pairs = dict(wire.header_pairs(message.response_headers))
            status = pairs.get(b":status", b"0")
            record.status = int(status) if status.isdigit() else 0
            record.t_headers = self.picker.gw.clock()
            served = wire.endpoint_list(wire.metadata_value(message, wire.LB_NAMESPACE, wire.SERVED_KEY)) \
                or wire.endpoint_list(pairs.get(wire.SERVED_KEY.encode(), b"").decode("latin-1"))
            if served:
                await self._served_by(served[0])
            if not pairs.get(b"content-type", b"").startswith(b"text/event-stream"):
                self.filter = None
            extra = {"x-m3gate-pool": record.pool, "x-m3gate-endpoint": record.replica,
                     QUEUE_MS_HEADER: queue_ms(record.queue_s)}
        await self.context.write(wire.response_headers_reply(extra))

    async def _served_by(self, endpoint: str) -> None:
        """Envoy retried on a fallback: the record, the in-flight count and the blame move to where it went."""
        record = self.record
        assert record is not None
        addresses = self.picker.addresses
        if not self.targets or await addresses.of(self.targets[0].replica.url) == endpoint:
            return
        # Envoy retries a 5xx, a reset or a refused connection alike, and says only where the answer came from: the
        # pick counts as a replica that answered a 5xx, by `serve`'s rule (blamed only if the fallback serves it)
        blame_answered_5xx([self.targets[0].replica], record.status, self.picker.gw.clock())
        for target in self.targets[1:]:
            if await addresses.of(target.replica.url) == endpoint:
                if self.guard is not None:
                    self.guard.release()
                profile = self.profile
                assert profile is not None
                output = record.output_predicted or profile.output_budget
                self.guard = target.replica.guard(profile.prompt_tokens + output, profile.prompt_tokens)
                record.pool, record.replica, record.reason = target.pool.name, target.replica.url, "retry"
                record.attempts, record.retried = 2, True
                self.picker.served_elsewhere += 1
                return

    async def on_response_body(self, body: ext.HttpBody) -> None:
        record = self.record
        if record is None or self.answered:
            await self.context.write(wire.response_body_reply(body.body, body.end_of_stream))
            return
        chunk = body.body
        if chunk and not record.t_first_byte:
            self._first_token()
        elif chunk and record.itl is not None and self.filter is not None:
            now = time.monotonic()
            counts, bounds = record.itl
            counts[bisect_left(bounds, now - self.last)] += 1.0
            self.last = now
        out = chunk
        if self.filter is not None:
            turn = record.session
            if turn is not None and turn.scanner is not None:
                turn.scanner.feed(chunk)
            out = self.filter.feed(chunk) + (self.filter.remainder() if body.end_of_stream else b"")
        else:
            self.response.append(chunk)
        await self.context.write(wire.response_body_reply(out, body.end_of_stream))
        if body.end_of_stream:
            await self._complete()

    def _first_token(self) -> None:
        record = self.record
        assert record is not None
        record.t_first_byte = self.last = time.monotonic()
        if self.guard is not None:
            self.guard.first_token()
        pool = self.picker.gw.pools.get(record.pool)
        replica = pool.replicas.get(record.replica) if pool is not None else None
        if replica is not None and self.filter is not None:
            self.picker.coordinator.learning.first_token(record, record.decision, replica)

    async def _complete(self) -> None:
        """The whole answer went through: what `serve` learns when its relay ends."""
        record = self.record
        assert record is not None
        gw = self.picker.gw
        record.t_last_byte = time.monotonic()
        if self.filter is not None:
            record.usage = self.filter.usage
            if record.itl is not None and record.t_first_byte:
                record.itl[0][-1] += self.last - record.t_first_byte
            if record.api in ("chat", "completions") and not self.filter.saw_done and record.status == 200:
                record.error = "upstream stream ended without [DONE]"
        else:
            answer = b"".join(self.response)
            if record.session is not None and gw.sessions is not None:
                gw.sessions.answered(record, answer)
            if record.status == 200:
                record.usage = usage_of(answer)
            pool = gw.pools.get(record.pool)
            replica = pool.replicas.get(record.replica) if pool is not None else None
            if replica is not None and record.status < 500:
                replica.record_success()
        await self.close()

    # the end ---------------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Once, however the exchange ended: the replica's in-flight count, then the coordinator's `finished`."""
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.release()
        record = self.record
        if record is None or record.done:
            return
        if not record.status:
            if self.picker.full or not self.targets:  # the stream ended before the answer did: the client left
                record.status, record.client_disconnected = 499, True
            else:  # none mode: Envoy closed the stream when the request ended; how it went is not seen here
                record.status = 200
                record.t_last_byte = time.monotonic()
        await self.picker.coordinator.finished(record)


def _has(request: Request, name: str) -> bool:
    raw = name.encode("latin-1")
    return any(k == raw for k, _ in request.scope["headers"])


class Addresses:
    """Replica URL → the `ip:port` Envoy knows the replica by (names resolved once, then every minute)."""

    TTL_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cache: dict[str, tuple[str, float]] = {}

    async def of(self, url: str) -> str:
        hit = self._cache.get(url)
        if hit is not None and hit[1] > self.clock():
            return hit[0]
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host)
            address = host
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
                address = str(infos[0][4][0]) if infos else host
            except OSError:
                address = host
        value = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        self._cache[url] = (value, self.clock() + self.TTL_S)
        return value
