"""The cheapest proxies the design packages allow: the measuring sticks for m3gate's own cost.

    python -m loadtests.floor_proxy [--server uvicorn|granian|granian-rsgi] PORT UPSTREAM_URL [UPSTREAM_URL ...]

Each relays every POST to the next upstream in turn with one shared aiohttp session: no routing, classification,
admission, metrics or error handling, just the two HTTP hops every Python gateway on these packages pays for.
Streaming responses are relayed chunk by chunk. The listening side is one of

- `uvicorn` (default): a raw ASGI app on uvicorn (uvloop + httptools), m3gate's listener;
- `granian`: the same raw ASGI app on granian (Rust HTTP server, hyper), embedded in this process on uvloop;
- `granian-rsgi`: granian's own RSGI interface (body and response handed over whole, no ASGI message dicts).

Used by loadtests.bench_overhead's reference segments (peers `floor`, `floor-granian`, `floor-granian-rsgi`), so
the ceiling of each listener stack is known; not part of the product. Granian is embedded (one process, its Rust
I/O threads beside the Python loop) so the process's CPU time is all of the proxy's.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import aiohttp

JSON = {"content-type": "application/json"}


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar(),
                                 auto_decompress=False)


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
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with state["http"].post(next(turn) + scope["path"], data=body, headers=JSON) as upstream:
            headers = [(b"content-type", upstream.headers.get("content-type", "application/json").encode())]
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


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
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(build(upstreams), host="127.0.0.1", port=int(port), loop="uvloop", http="httptools",
                    log_level="warning", access_log=False)
    elif server in ("granian", "granian-rsgi"):
        rsgi = server == "granian-rsgi"
        serve_granian(RsgiRelay(upstreams) if rsgi else build(upstreams), int(port), rsgi)
    else:
        print(f"unknown --server {server!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
