"""The signs of a replica shutting down, as vLLM 0.32 gives them (docs/stream-migration.md section 5): a 500 whose
message is "cannot schedule new futures after shutdown" (SIGTERM with --shutdown-timeout N > 0), a refused
connection (N = 0, or the process gone), a 503 on /health (engine dead). Ordinary failures must not read as one."""

from __future__ import annotations

import asyncio
import errno
import socket

import aiohttp
import orjson
import pytest

from policies.vllm_wire import SHUTDOWN_REFUSAL, connection_refused, health_says_draining, refuses_new_requests

# vLLM 0.32's answer, byte for byte as a live server gave it
LIVE_REFUSAL = (b'{"error":{"message":"cannot schedule new futures after shutdown","type":"InternalServerError",'
                b'"param":null,"code":500}}')


def test_the_live_servers_refusal_reads_as_shutting_down() -> None:
    assert refuses_new_requests(500, LIVE_REFUSAL)
    assert orjson.loads(LIVE_REFUSAL)["error"]["message"] == SHUTDOWN_REFUSAL


@pytest.mark.parametrize(("status", "body"), [
    (500, b'{"error":{"message":"Internal server error: the engine failed","type":"InternalServerError"}}'),
    (503, LIVE_REFUSAL),  # only vLLM's 500 carries it
    (200, b'{"choices":[{"text":"cannot schedule new futures after shutdown"}]}'),  # an answer that quotes it
    (500, b'cannot schedule new futures after shutdown'),  # not vLLM's error shape
    (500, b'{"error":"cannot schedule new futures after shutdown"}'),
    (500, b'{"detail":{"message":"cannot schedule new futures after shutdown"}}'),
    (500, b""),
])
def test_other_answers_are_not_a_shutdown(status: int, body: bytes) -> None:
    assert not refuses_new_requests(status, body)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: nothing listens there


def test_a_refused_connection_through_aiohttp() -> None:
    async def attempt() -> BaseException:
        async with aiohttp.ClientSession() as session:
            try:
                await session.get(f"http://127.0.0.1:{_closed_port()}/health")
            except aiohttp.ClientError as exc:
                return exc
        raise AssertionError("nothing listens there")

    assert connection_refused(asyncio.run(attempt()))


def test_only_a_refusal_is_a_refused_connection() -> None:
    assert connection_refused(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = ConnectionRefusedError()
    assert connection_refused(wrapped)
    assert not connection_refused(ConnectionResetError(errno.ECONNRESET, "reset"))  # it was listening: a stream died
    assert not connection_refused(TimeoutError())
    assert not connection_refused(aiohttp.ServerDisconnectedError())
    assert not connection_refused(None)


def test_health_503_means_draining_and_other_failures_do_not() -> None:
    assert health_says_draining(503)
    assert not any(health_says_draining(s) for s in (200, 404, 500, 502, 504))
