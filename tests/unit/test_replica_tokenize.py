"""The one /tokenize client (pools/replica_tokenize.py): an answer read once as bytes, its ids spliced or parsed,
a malformed answer none, a replica shutting down (vLLM's refusal, a refused connection) told apart. Against a real
HTTP server on loopback."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gateway.cli.launcher import free_port
from pools.replica_tokenize import TokenizeAnswer, post_tokenize

REFUSAL = (b'{"error":{"message":"cannot schedule new futures after shutdown","type":"InternalServerError",'
           b'"param":null,"code":500}}')


def test_an_answer_gives_its_ids_as_bytes_its_count_and_its_tokens() -> None:
    answer = TokenizeAnswer(200, b'{"count":3,"max_model_len":8192,"tokens":[7,8,9],"token_strs":null}')
    assert answer.ids() == b"7,8,9" and answer.count() == 3 and answer.tokens() == [7, 8, 9]
    assert not answer.shutting_down


def test_a_malformed_or_failed_answer_gives_nothing() -> None:
    for answer in (TokenizeAnswer(200, b"[1,2]"), TokenizeAnswer(200, b"oops"), TokenizeAnswer(200, b'{"count":1}'),
                   TokenizeAnswer(400, b'{"count":3,"tokens":[1,2,3]}'), TokenizeAnswer(0, error=TimeoutError())):
        assert answer.ids() is None and answer.tokens() is None
        assert answer.count() is None or answer.status == 200


def test_a_replica_shutting_down_or_gone_is_told_apart() -> None:
    async def run() -> None:
        async def tokenize(request: web.Request) -> web.Response:
            return web.Response(status=500, body=REFUSAL, content_type="application/json")

        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                refusing = await post_tokenize(session, f"http://127.0.0.1:{port}", b'{"prompt":"x"}')
                gone = await post_tokenize(session, f"http://127.0.0.1:{free_port()}", b'{"prompt":"x"}')
        finally:
            await runner.cleanup()
        assert refusing.status == 500 and refusing.shutting_down and not refusing.refused
        assert gone.status == 0 and gone.refused and gone.shutting_down and gone.ids() is None

    asyncio.run(run())
