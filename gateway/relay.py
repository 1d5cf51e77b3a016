"""One upstream call per attempt, relayed back byte for byte.

aiohttp is the upstream client (httpx's pool tops out near 100 req/s at c=64 here; aiohttp relays >10x that).
Streaming responses are forwarded event by event as they arrive. The only bytes m3gate changes are the usage chunk
it asked for itself (`stream_options.include_usage` added so it can count tokens), which the client never sees.
A failure before the first byte is retried elsewhere; after it, a resumable chat or completions stream goes on on
another replica (gateway/migration/), and any other stream ends with an SSE error event, never a silent cut.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.record import RequestRecord
from policies.collected import answer_from_events
from pools.replicas import LoadGuard
from pools.tasks import Periodic

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)
# Client credentials are the gateway's business, never a replica's.
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "x-api-key", "cookie", "accept-encoding", "expect"}
RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_NOT_FORWARDED_BYTES = frozenset(name.encode() for name in NOT_FORWARDED)


def upstream_payload(
    body: dict[str, Any], raw: bytes, api: str, model: str, stream: bool, priority: int | None = None,
    token_ids: bool = False, force_stream: bool = False,
) -> tuple[bytes, bool]:
    """The body sent to the replica: unchanged bytes unless routing needs a change. Returns (payload, strip_usage).

    Aliases are rewritten to the served model id, and a streamed chat/completion asks for the usage chunk so the
    gateway learns token counts (the client never sees that chunk unless it asked for it). `priority` is the traffic
    class's, for pools whose vLLM schedules by priority (it replaces any the client sent). `token_ids`: a resumable
    stream asks for `return_token_ids` (gateway/migration/ strips them from what the client gets). `force_stream`: a
    non-streamed request sent upstream as a stream (policies/collected.py).

    Fields the client did not send are spliced in before the body's closing brace rather than writing the whole body
    again (a 3 MB prompt costs ~2.5 ms to serialise); a field it sent with another value means writing it again."""
    added: dict[str, Any] = {}  # fields the client did not send
    changed = False  # a field it sent, now with another value

    def put(key: str, value: Any) -> None:
        nonlocal changed
        if key in body:
            changed = True
        else:
            added[key] = value
        body[key] = value

    if force_stream and body.get("stream") is not True:
        put("stream", True)
    if priority is not None and body.get("priority") != priority:
        put("priority", priority)
    if body.get("model") != model:
        put("model", model)
    strip_usage = False
    if stream and api in ("chat", "completions"):
        options = body.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            put("stream_options", {**(options if isinstance(options, dict) else {}), "include_usage": True})
            strip_usage = True
        if token_ids:
            put("return_token_ids", True)
    if changed:
        return orjson.dumps(body), strip_usage
    if added:
        return _splice(raw, added) if len(body) > len(added) else orjson.dumps(body), strip_usage
    return raw, strip_usage


def _splice(raw: bytes, fields: dict[str, Any]) -> bytes:
    """`raw` (a non-empty JSON object) with `fields`, none of which it has, added as its last members."""
    end = len(raw.rstrip())  # JSON allows whitespace after the closing brace
    members = orjson.dumps(fields)  # {"a":1,"b":2}: its members, without the braces, follow a comma
    return b"".join((memoryview(raw)[:end - 1], b",", memoryview(members)[1:]))


def upstream_headers(raw: list[tuple[bytes, bytes]], api_key: str | None) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones, credentials and m3gate's own; the pool's key when it has one."""
    headers: dict[str, str] = {}
    for k, v in raw:  # ASGI servers give header names in lower case
        if k in _NOT_FORWARDED_BYTES or k.startswith(b"x-m3gate-"):
            continue
        headers[k.decode("latin-1")] = v.decode("latin-1")
    headers["content-type"] = "application/json"
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}  # the gateway's own server sets date and server


def response_headers(upstream: Mapping[str, str], extra: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The replica's response headers the client gets (lower-cased, hop-by-hop ones dropped), then `extra`."""
    out = [(name.encode("latin-1"), v.encode("latin-1")) for k, v in upstream.items()
           if (name := k.lower()) not in _NOT_RELAYED]  # each name lower-cased once: this runs on every answer
    out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return out


class SseFilter:
    """Splits an SSE byte stream at event boundaries, remembers the usage chunk and drops it when m3gate injected it.

    Everything else passes through unchanged. Works for vLLM's `data: ...\\n\\n` framing and the Responses API's
    `event: ...\\ndata: ...\\n\\n` framing alike.
    """

    __slots__ = ("_buf", "strip_usage", "usage", "saw_done", "events", "failure", "waiting")

    def __init__(self, strip_usage: bool) -> None:
        self._buf = b""
        self.waiting = False  # the relay waits on the client (a stall watch does not count that as silence)
        self.failure: str | None = None  # the replica ended the answer itself (gateway/migration/'s IdFilter)
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None
        self.saw_done = False
        self.events = 0

    def _complete(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes (with what was buffered), keeping the partial last one for later."""
        buf = self._buf + chunk if self._buf else chunk
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._buf = buf
            return b""
        complete, self._buf = buf[: cut + 2], buf[cut + 2 :]
        return complete

    def feed(self, chunk: bytes) -> bytes:
        complete = self._complete(chunk)
        if not complete:
            return b""
        self.events += complete.count(b"\n\n")
        if b"[DONE]" in complete:
            self.saw_done = True
        if b'"usage"' not in complete and b'"response.completed"' not in complete:
            return complete
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            if (b'"usage"' in event or b'"response.completed"' in event) and self._take_usage(event) \
                    and self.strip_usage:
                continue
            kept.append(event)
        return b"".join(e + b"\n\n" for e in kept)

    def _take_usage(self, event: bytes) -> bool:
        """True when `event` is the usage-only chunk (choices: []); records usage from it or a final response."""
        data_at = event.find(b"data:")
        if data_at < 0:
            return False
        payload = event[data_at + 5 :].strip()
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        if isinstance(obj.get("response"), dict) and isinstance(obj["response"].get("usage"), dict):
            self.usage = obj["response"]["usage"]  # Responses API: response.completed
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            return obj.get("choices") == []
        return False

    def remainder(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


def stream_error_event(api: str, message: str, code: int = 502) -> bytes:
    """How a stream that already started says it failed, in each API's own framing."""
    if api == "responses":
        body = orjson.dumps({"type": "error", "code": str(code), "message": message, "param": None})
        return b"event: error\ndata: " + body + b"\n\n"
    if api == "messages":
        body = orjson.dumps({"type": "error", "error": {"type": "api_error", "message": message}})
        return b"event: error\ndata: " + body + b"\n\n"
    body = orjson.dumps({"error": {"message": message, "type": "upstream_error", "param": None, "code": code}})
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


class CollectedAnswer:
    """ASGI response for a non-streamed request the gateway sent upstream as a stream (a background request, so that
    the lane can pause it and resume it exactly; docs/scheduling.md): its relay, resumptions included, runs into a
    buffer, and the client gets the one JSON object a non-streamed answer is (policies/collected.py). A client that
    leaves meanwhile gets nothing; the relay ends the upstream request as for any stream."""

    _STREAM_HEADERS = frozenset({b"content-type", b"content-length", b"transfer-encoding", b"cache-control"})

    def __init__(self, relay: StreamRelay, api: str) -> None:
        self.relay = relay
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = []
        events: list[bytes] = []

        async def collect(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers.extend(message.get("headers") or ())
            elif message["type"] == "http.response.body":
                events.append(message.get("body", b""))

        await self.relay(scope, receive, collect)
        if self.relay.record.client_disconnected:
            return
        status, body = answer_from_events(b"".join(events), self.api)
        kept = [(k, v) for k, v in headers if k.lower() not in self._STREAM_HEADERS]
        await send({"type": "http.response.start", "status": status, "headers": [
            *kept, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Held:
    """What one upstream attempt holds: the replica's load guard and the upstream response, released together,
    once, on every path (gateway/upstream.py; a stream's `StreamRelay` releases it when the stream ends)."""

    __slots__ = ("guard", "response")

    def __init__(self, guard: LoadGuard) -> None:
        self.guard = guard
        self.response: aiohttp.ClientResponse | None = None

    def close(self, abort: bool = False) -> None:
        """Release both. `abort`: close the connection (how vLLM learns to abort), not return it to the pool."""
        response, self.response = self.response, None
        if response is not None:
            if abort:
                response.close()
            else:
                response.release()
        self.guard.release()


class StreamRelay:
    """ASGI response that pumps an open upstream SSE response to the client.

    It owns the attempt's `Held` (the upstream response and the replica's load guard) and releases it however the
    stream ends: upstream finished, upstream broke (→ SSE error event), or the client went away (→ upstream closed,
    so vLLM aborts).
    """

    def __init__(
        self,
        held: Held,
        status: int,
        headers: list[tuple[bytes, bytes]],
        record: RequestRecord,
        strip_usage: bool,
        on_done: Callable[[RequestRecord], Awaitable[None] | None],
        first_chunk: bytes = b"",
        filt: SseFilter | None = None,
        resume: Callable[[Send, Any, str], Awaitable[None]] | None = None,
    ) -> None:
        assert held.response is not None
        self.held = held
        self.upstream = held.response
        self.status = status
        self.headers = headers
        self.record = record
        self.filter = filt if filt is not None else SseFilter(strip_usage)
        # a chat/completions stream broken after its first byte: resumed elsewhere, or ended (gateway/migration/)
        self.resume = resume
        self.on_done = on_done
        self.first_chunk = first_chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not pump.done():
                self.record.client_disconnected = True
                pump.cancel()
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                raise pump.exception()  # type: ignore[misc]
        finally:
            watch.cancel()
            if not pump.done():
                pump.cancel()
            self.held.close(abort=True)  # closing the connection is how vLLM learns to abort
            self.record.t_last_byte = self.record.t_last_byte or time.monotonic()
            result = self.on_done(self.record)
            if asyncio.iscoroutine(result):
                await result

    async def read_ahead(self) -> bytes:
        """More of the stream before any of it is relayed: appended to what the client gets first."""
        more = await self.upstream.content.readany()
        self.first_chunk += more
        return more

    def abandon(self) -> None:
        """A stream never handed to the client: closed (vLLM aborts) and its in-flight count released."""
        self.held.close(abort=True)

    async def _pump(self, send: Send) -> None:
        record = self.record
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        filt = self.filter
        # telemetry's inter-token latency series for this stream, if any (metrics.BucketSeries): observed inline,
        # one bucket count per gap (~0.1 µs a chunk); the gaps' sum, last chunk - first, is added once at the end
        itl = record.itl
        counts, bounds = itl if itl is not None else (None, ())
        last = record.t_first_byte
        turn = record.session  # an agent session's turn: its answer's tool-call ids are read as the bytes pass
        scanner = turn.scanner if turn is not None else None
        try:
            if self.first_chunk:
                if scanner is not None:
                    scanner.feed(self.first_chunk)
                out = filt.feed(self.first_chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            first = not self.first_chunk
            async for chunk in self.upstream.content.iter_any():
                if first:  # a replica sends a stream's headers at once: its first bytes are the first token's event
                    record.t_first_byte = last = time.monotonic()
                    first = False
                elif counts is not None:  # the gap since the previous chunk (a chunk is usually one token's event)
                    now = time.monotonic()
                    counts[bisect_left(bounds, now - last)] += 1.0
                    last = now
                if scanner is not None:
                    scanner.feed(chunk)
                out = filt.feed(chunk)
                if out:
                    filt.waiting = True
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    filt.waiting = False
            tail = filt.remainder()
            if record.api in ("chat", "completions") and (filt.failure is not None or not filt.saw_done):
                record.error = "upstream stream ended without [DONE]"
                if self.resume is not None:
                    await self.resume(send, filt, filt.failure or "closed")
                    return
                tail += stream_error_event(record.api, "the replica closed the stream before it finished; retry")
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            record.error = f"upstream failed mid-stream: {type(exc).__name__}"
            if self.resume is not None:  # resumed, or (Responses, Messages, ...) counted refused and ended
                await self.resume(send, filt, filt.failure or type(exc).__name__)
                return
            tail = filt.remainder() + stream_error_event(record.api, "the replica failed mid-stream; retry the request")
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            record.t_last_byte = time.monotonic()
            record.usage = record.usage or filt.usage
            if counts is not None and record.t_first_byte:
                counts[-1] += last - record.t_first_byte


class DisconnectWatch:
    """Cancels the handler if the client goes away while it waits on a replica; the cancellation closes the
    upstream connection, which is how vLLM learns to abort. The watching task starts only once the request has
    waited a little (`DisconnectWatches.delay`, 0.1 s): most answers come sooner, and a task per request (created,
    then cancelled) would cost ~3% of the gateway's CPU. A client gone earlier is noticed then, so a replica may compute
    up to 0.1 s for nobody. Stop it before handing the
    response to a `StreamRelay` (which watches for itself), so it cannot swallow the disconnect message."""

    __slots__ = ("disconnected", "stopped", "_target", "_task", "_receive")

    def __init__(self, receive: Receive) -> None:
        self.disconnected = False
        self.stopped = False
        self._target = asyncio.current_task()
        self._receive = receive
        self._task: asyncio.Future[None] | None = None

    def start(self) -> None:
        if not self.stopped and self._task is None:
            self._task = asyncio.ensure_future(self._watch(self._receive))

    async def _watch(self, receive: Receive) -> None:
        await _wait_for_disconnect(receive)
        self.disconnected = True
        if self._target is not None:
            self._target.cancel()

    def stop(self) -> None:
        self.stopped = True
        if self._task is not None:
            self._task.cancel()


class DisconnectWatches:
    """Starts each request's DisconnectWatch once it has waited `delay` seconds, from one ticker: a deque append per
    request instead of a timer (a libuv timer per request cost more than the watching it saves). The ticker runs
    only while a watch waits: an idle gateway has no timer here."""

    def __init__(self, delay: float = 0.1) -> None:
        self.delay = delay
        self._due: deque[tuple[float, DisconnectWatch]] = deque()
        self._started = False
        self._ticker = Periodic("m3gate-disconnect-watch", self._start_due, lambda: self.delay / 2,
                                while_=lambda: bool(self._due))

    def watch(self, receive: Receive) -> DisconnectWatch:
        watch = DisconnectWatch(receive)
        if not self._started:  # not started (an app used without its lifespan): watch at once
            watch.start()
        else:
            self._due.append((time.monotonic() + self.delay, watch))
            self._ticker.start()  # a no-op while it runs
        return watch

    def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._started = False
        await self._ticker.stop()
        while self._due:
            self._due.popleft()[1].start()

    def _start_due(self) -> None:
        due, now = self._due, time.monotonic()
        while due and due[0][0] <= now:
            due.popleft()[1].start()


class RawResponse(Response):
    """A complete upstream body with the upstream's own headers, sent as is."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes):
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # Starlette's, minus what it never needs
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})

