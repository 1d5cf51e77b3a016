"""The one mapping from a failed upstream call to its failure: a timeout of any kind is a 504 `upstream_timeout`
(asyncio.TimeoutError is TimeoutError, an OSError; aiohttp's read timeouts are ClientErrors too), and only a
connection never made leaves the replica untouched (a KV transfer prepared for it may be reused)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from gateway.upstream import Failed, failure_of
from pools.replicas import Replica

REPLICA = Replica(url="http://10.0.0.1:8000", pool="interactive")
KEY = ConnectionKey("10.0.0.1", 8000, False, True, None, None, None)


@pytest.mark.parametrize(("exc", "kind", "reached"), [
    (asyncio.TimeoutError(), "timeout", True),
    (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), "timeout", True),
    (aiohttp.SocketTimeoutError("Timeout on reading data from socket"), "timeout", True),
    (aiohttp.ConnectionTimeoutError("Connection timeout to host"), "timeout", False),
    (aiohttp.ClientConnectorError(KEY, ConnectionRefusedError(111, "refused")), "unreachable", False),
    (aiohttp.ServerDisconnectedError(), "unreachable", True),
    (aiohttp.ClientPayloadError("truncated"), "unreachable", True),
    (ConnectionResetError(104, "reset"), "unreachable", True),
    (socket.gaierror(-2, "unknown host"), "unreachable", True),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_each_failure_maps_to_its_kind(exc: BaseException, kind: str, reached: bool) -> None:
    failed = failure_of(exc, REPLICA, "interactive")
    assert (failed.kind, failed.reached_replica) == (kind, reached)
    error = failed.error()
    if kind == "timeout":
        assert (error.status, error.code) == (504, "upstream_timeout")
        assert "did not answer in time" in error.message
    else:
        assert (error.status, error.code) == (502, "upstream_unreachable")
        assert type(exc).__name__ in error.message


def test_failures_the_relay_makes_itself_keep_their_codes() -> None:
    assert Failed("answered_5xx", "replica answered 503", True).error().code == "upstream_error"
    assert Failed("kv_transfer_failed", "no KV", True).error().status == 502
    draining = Failed("draining", "replica is shutting down", False).error()  # the last replica left refused it
    assert (draining.status, draining.code) == (503, "replica_draining")
