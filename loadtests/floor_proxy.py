"""The cheapest proxy the design packages allow: the measuring stick for m3gate's own cost.

    python -m loadtests.floor_proxy PORT UPSTREAM_URL [UPSTREAM_URL ...]

A raw ASGI app on uvicorn (uvloop + httptools) relaying each POST to the next upstream in turn with one shared
aiohttp session: no routing, classification, admission, metrics or error handling, just the two HTTP hops every
Python gateway on these packages pays for. Streaming responses are relayed chunk by chunk. Used by
loadtests.bench_overhead's reference segment; not part of the product.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import aiohttp
import uvicorn


def build(upstreams: list[str]) -> Any:
    turn = itertools.cycle(upstreams)
    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["http"] = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar(),
                        auto_decompress=False)
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
        async with state["http"].post(next(turn) + scope["path"], data=body,
                                      headers={"content-type": "application/json"}) as upstream:
            headers = [(b"content-type", upstream.headers.get("content-type", "application/json").encode())]
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


def main(argv: list[str]) -> int:
    port, *upstreams = argv
    uvicorn.run(build(upstreams), host="127.0.0.1", port=int(port), loop="uvloop", http="httptools",
                log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
