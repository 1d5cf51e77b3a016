"""The cheapest proxies the design packages allow: the measuring sticks for m3gate's own cost.

    python -m loadtests.lib.floor_proxy [--server uvicorn|granian|granian-rsgi|raw|granian-rsgi-raw] PORT UPSTREAM_URL ...

Each relays every POST to the next upstream in turn with one shared aiohttp session: no routing, classification,
admission, metrics or error handling, just the two HTTP hops every Python gateway on these packages pays for.
Streaming responses are relayed chunk by chunk. The listening side is one of

- `uvicorn` (default): a raw ASGI app on uvicorn (uvloop + httptools), m3gate's listener;
- `granian`: the same raw ASGI app on granian (Rust HTTP server, hyper), embedded in this process on uvloop;
- `granian-rsgi`: granian's own RSGI interface (body and response handed over whole, no ASGI message dicts);
- `raw`, `granian-rsgi-raw`: uvicorn, or granian RSGI, with a minimal keep-alive HTTP/1.1 client (asyncio protocol +
  httptools, `RawClient`) upstream instead of aiohttp: what the client stack costs.

Used by loadtests.bench.overhead's reference segments (peers `floor`, `floor-granian`, `floor-granian-rsgi`), so
the ceiling of each listener stack is known; not part of the product. Granian is embedded (one process, its Rust
I/O threads beside the Python loop) so the process's CPU time is all of the proxy's.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httptools

JSON = {"content-type": "application/json"}


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar(),
                                 auto_decompress=False)


async def _ok(send: Any) -> None:
    """Any GET (the health probe): 200 "ok"."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _body(receive: Any) -> bytes:
    """The whole request body, as the ASGI server hands it over."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def build(upstreams: list[str]) -> Any:
    """The raw ASGI relay (uvicorn or granian)."""
    turn = itertools.cycle(upstreams)
    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["http"] = _session()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await state["http"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] != "POST":
            await _ok(send)
            return
        body = await _body(receive)
        async with state["http"].post(next(turn) + scope["path"], data=body, headers=JSON) as upstream:
            headers = [(b"content-type", upstream.headers.get("content-type", "application/json").encode())]
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


class _Conn(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to an upstream, its response parsed by httptools: a response's body
    arrives in `chunks` (de-chunked), `done` when it is complete."""

    def __init__(self, pool: RawClient, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.ctype = b"application/json"
        self.chunks: deque[bytes] = deque()
        self.done = False
        self.failed = False
        self.waiter: asyncio.Future[None] | None = None
        self.headers_seen: asyncio.Future[None] | None = None
        self._name = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.connection_lost(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.failed = True
        self.done = True
        self._wake()
        if self.headers_seen is not None and not self.headers_seen.done():
            self.headers_seen.set_exception(ConnectionError("upstream closed"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.headers_seen is not None and not self.headers_seen.done():
            self.headers_seen.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def request(self, head: bytes, body: bytes) -> None:
        self.status, self.done, self.ctype = 0, False, b"application/json"
        self.chunks.clear()
        self.headers_seen = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(head + body)
        await self.headers_seen

    async def body_chunks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        while True:
            if self.chunks:  # everything parsed from the reads so far, as one piece (as aiohttp's iter_any)
                data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                yield data
            if self.done:
                break
            self.waiter = loop.create_future()
            await self.waiter
        if not self.failed and self.parser.should_keep_alive():
            self.pool.idle.setdefault(self.key, []).append(self)
        elif self.transport is not None:
            self.transport.close()


class RawClient:
    """A minimal keep-alive HTTP/1.1 client on asyncio protocols + httptools: a connection per request in flight,
    reused after, no timeouts or retries. Shows what aiohttp's client costs against the least a Python relay can
    do (peers `floor-raw`, `floor-granian-rsgi-raw`); not a product client."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], list[_Conn]] = {}

    async def post(self, url: str, body: bytes) -> _Conn:
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        idle = self.idle.get(key)
        conn = idle.pop() if idle else None
        if conn is None or conn.failed:
            _, conn = await asyncio.get_running_loop().create_connection(lambda: _Conn(self, key), *key)
        head = (f"POST {parts.path} HTTP/1.1\r\nhost: {key[0]}:{key[1]}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        await conn.request(head, body)
        return conn


def build_raw(upstreams: list[str]) -> Any:
    """The raw ASGI relay with RawClient upstream."""
    turn = itertools.cycle(upstreams)
    client = RawClient()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] != "POST":
            await _ok(send)
            return
        body = await _body(receive)
        conn = await client.post(next(turn) + scope["path"], body)
        await send({"type": "http.response.start", "status": conn.status, "headers": [(b"content-type", conn.ctype)]})
        async for chunk in conn.body_chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


class RsgiRawRelay:
    """The RSGI relay with RawClient upstream: the cheapest Python relay measured here."""

    def __init__(self, upstreams: list[str]) -> None:
        self.turn = itertools.cycle(upstreams)
        self.client = RawClient()

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.method != "POST":
            proto.response_bytes(200, [("content-type", "text/plain")], b"ok")
            return
        conn = await self.client.post(next(self.turn) + scope.path, await proto())
        ctype = conn.ctype.decode("latin-1")
        if ctype.startswith("application/json"):
            proto.response_bytes(conn.status, [("content-type", ctype)], b"".join([c async for c in conn.body_chunks()]))
            return
        transport = proto.response_stream(conn.status, [("content-type", ctype)])
        async for chunk in conn.body_chunks():
            await transport.send_bytes(chunk)


class RsgiRelay:
    """The same relay as an RSGI app: `await proto()` is the whole body, `response_bytes` / `response_stream` the
    answer (one call, or one per chunk)."""

    def __init__(self, upstreams: list[str]) -> None:
        self.turn = itertools.cycle(upstreams)
        self.http: aiohttp.ClientSession | None = None

    def __rsgi_init__(self, loop: Any) -> None:
        self.http = _session()

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.method != "POST":
            proto.response_bytes(200, [("content-type", "text/plain")], b"ok")
            return
        body = await proto()
        assert self.http is not None
        async with self.http.post(next(self.turn) + scope.path, data=body, headers=JSON) as upstream:
            ctype = upstream.headers.get("content-type", "application/json")
            if upstream.content_length is not None:  # a whole answer: one response call
                proto.response_bytes(upstream.status, [("content-type", ctype)], await upstream.read())
                return
            transport = proto.response_stream(upstream.status, [("content-type", ctype)])
            async for chunk in upstream.content.iter_any():
                await transport.send_bytes(chunk)


def serve_granian(app: Any, port: int, rsgi: bool) -> None:
    import asyncio

    import uvloop
    from granian.constants import Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    server = Server(app, address="127.0.0.1", port=port, interface=Interfaces.RSGI if rsgi else Interfaces.ASGI,
                    websockets=False, log_level=LogLevels.warning, backlog=2048)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(server.serve())


def main(argv: list[str]) -> int:
    server = "uvicorn"
    if argv and argv[0] == "--server":
        server, argv = argv[1], argv[2:]
    port, *upstreams = argv
    if server in ("uvicorn", "raw"):
        import uvicorn

        uvicorn.run((build_raw if server == "raw" else build)(upstreams), host="127.0.0.1", port=int(port),
                    loop="uvloop", http="httptools", log_level="warning", access_log=False)
    elif server in ("granian", "granian-rsgi"):
        rsgi = server == "granian-rsgi"
        serve_granian(RsgiRelay(upstreams) if rsgi else build(upstreams), int(port), rsgi)
    elif server == "granian-rsgi-raw":
        serve_granian(RsgiRawRelay(upstreams), int(port), True)
    else:
        print(f"unknown --server {server!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
