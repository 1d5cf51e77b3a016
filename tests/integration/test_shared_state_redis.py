"""Two `RedisState`s ("gateways" in one process, each with its own callbacks) against a real Redis: dispatches
propagate, in-flight counts are summed and expire, and losing Redis costs nothing but sharing until it returns.

The machine's Redis (127.0.0.1:6379, db 7) is used with a fresh key prefix per test, and only those keys are
deleted; the outage test runs its own `redis-server` on a free port, since it stops it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from policies.snapshot import RoutingRequest
from pools.shared_state import RedisState
from tests.support.shared import SHARED_REDIS, eventually
from loadtests.lib.private_redis import PrivateRedis

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.tools("redis-server")


class Applied:
    """An apply_remote callback that remembers what it got and when (monotonic)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, str, RoutingRequest]] = []

    def __call__(self, pool: str, replica: str, request: RoutingRequest) -> None:
        self.calls.append((time.monotonic(), pool, replica, request))

    def replicas(self) -> list[str]:
        return [c[2] for c in self.calls]


def _state(url: str, prefix: str, applied: Applied, counts: dict[str, int], **kwargs: object) -> RedisState:
    return RedisState(url, applied, lambda: counts, key_prefix=prefix, **kwargs)  # type: ignore[arg-type]


async def test_a_dispatch_reaches_the_other_gateway_only(prefix: str) -> None:
    got_a, got_b = Applied(), Applied()
    a = _state(SHARED_REDIS, prefix, got_a, {})
    b = _state(SHARED_REDIS, prefix, got_b, {})
    await a.start()
    await b.start()
    try:
        assert a.available and b.available and a.gateway_id != b.gateway_id
        request = RoutingRequest(6000, 512, tuple(range(10**6, 10**6 + 400)), "session-1")
        sent = time.monotonic()
        a.on_dispatch("interactive", "http://10.0.0.1:8000", request)
        await eventually(lambda: len(got_b.calls) == 1, within=1.0)  # typically 15-35 ms (loadtests/bench_...)
        at, pool, replica, applied = got_b.calls[0]
        assert at - sent < 1.0
        assert (pool, replica) == ("interactive", "http://10.0.0.1:8000")
        assert applied.session_key == "session-1" and (applied.prompt_tokens, applied.output_budget) == (6000, 512)
        assert applied.block_hashes == request.block_hashes[:256]  # the leading blocks identify the prefix

        for i in range(300):  # a burst keeps its order and loses nothing
            (a if i % 2 else b).on_dispatch("interactive", f"http://r{i}", RoutingRequest(1, 1, (i,), None))
        await eventually(lambda: len(got_b.calls) == 151 and len(got_a.calls) == 150, within=1.0)
        assert got_b.replicas()[1:] == [f"http://r{i}" for i in range(1, 300, 2)]
        assert got_a.replicas() == [f"http://r{i}" for i in range(0, 300, 2)]  # never its own dispatches
        # (A counts after its pipeline returns, which may be after B has already read the entry)
        await eventually(lambda: a.counters.entries_sent == 151 and b.counters.entries_applied == 151, 1.0)
        assert a.counters.errors == b.counters.errors == 0
    finally:
        await a.stop()
        await b.stop()


async def test_remote_in_flight_sums_other_gateways_and_vanishes_when_one_stops(prefix: str) -> None:
    counts_a = {"http://r1": 3, "http://r2": 0}
    counts_b = {"http://r1": 5}
    counts_c = {"http://r1": 1, "http://r3": 2}
    a = _state(SHARED_REDIS, prefix, Applied(), counts_a)
    b = _state(SHARED_REDIS, prefix, Applied(), counts_b)
    c = _state(SHARED_REDIS, prefix, Applied(), counts_c)
    for s in (a, b, c):
        await s.start()
    try:
        await eventually(lambda: b.remote_in_flight("http://r1") == 4 and b.remote_in_flight("http://r3") == 2, 1.0)
        assert b.remote_in_flight("http://r2") == 0 and b.remote_in_flight("http://unknown") == 0
        await eventually(lambda: a.remote_in_flight("http://r1") == 6, 1.0)  # b + c, never its own 3

        counts_a.update({"http://r1": 0, "http://r2": 7})  # a's requests finish and new ones start
        await eventually(lambda: b.remote_in_flight("http://r1") == 1 and b.remote_in_flight("http://r2") == 7, 1.0)

        await c.stop()  # a clean stop withdraws its counts at once, without waiting for the TTL
        waited = await eventually(lambda: b.remote_in_flight("http://r3") == 0, 1.0)
        assert waited < 1.0  # far below the 3 s TTL
        assert b.remote_in_flight("http://r2") == 7
    finally:
        for s in (a, b, c):
            await s.stop()


async def test_capacity_shares_are_exchanged_expire_by_ttl_and_are_withdrawn_on_stop(prefix: str) -> None:
    a = _state(SHARED_REDIS, prefix, Applied(), {})
    b = _state(SHARED_REDIS, prefix, Applied(), {})
    c = _state(SHARED_REDIS, prefix, Applied(), {})
    for s in (a, b, c):
        await s.start()
    try:
        # the registry is read by the poller: a peer counts once each has flushed and been polled
        await eventually(lambda: len(a._peers) == 2 and len(b._peers) == 2, 2.0)
        assert await a.exchange_capacity(b"share-a", 10.0) == [(a.gateway_id, b"share-a")]  # nobody else yet
        assert await c.exchange_capacity(b"share-c", 0.5) == [(c.gateway_id, b"share-c"), (a.gateway_id, b"share-a")]
        got = dict(await b.exchange_capacity(b"share-b", 10.0) or [])
        assert got == {a.gateway_id: b"share-a", b.gateway_id: b"share-b", c.gateway_id: b"share-c"}
        assert b.counters.capacity_exchanges == 1 and b.counters.capacity_shares_read == 2

        await asyncio.sleep(0.7)  # c stopped publishing (it still flushes and stays registered): its TTL ran out
        assert dict(await b.exchange_capacity(b"share-b", 10.0) or []).keys() == {a.gateway_id, b.gateway_id}

        await a.stop()  # a clean stop withdraws the share at once, long before its 10 s TTL
        assert dict(await b.exchange_capacity(b"share-b", 10.0) or []).keys() == {b.gateway_id}
    finally:
        for s in (a, b, c):
            await s.stop()
    assert await b.exchange_capacity(b"share-b", 10.0) is None  # stopped: nothing is shared


@pytest.fixture
def crashed_gateway_script() -> str:
    return (
        "import asyncio, sys\n"
        "from pools.shared_state import RedisState\n"
        "async def main():\n"
        "    s = RedisState(sys.argv[1], lambda *a: None, lambda: {'http://crash': 4}, key_prefix=sys.argv[2],\n"
        "                   inflight_ttl_s=1.0)\n"
        "    await s.start()\n"
        "    print('ready', s.gateway_id, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )


async def test_a_crashed_gateways_in_flight_expires_by_ttl(prefix: str, crashed_gateway_script: str) -> None:
    b = _state(SHARED_REDIS, prefix, Applied(), {})
    await b.start()
    proc = subprocess.Popen([sys.executable, "-c", crashed_gateway_script, SHARED_REDIS, prefix], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.startswith(b"ready"), line
        await eventually(lambda: b.remote_in_flight("http://crash") == 4, 2.0)
        os.kill(proc.pid, signal.SIGKILL)  # no goodbye: only the TTL can clear its counts
        proc.wait(5)
        killed = time.monotonic()
        await eventually(lambda: b.remote_in_flight("http://crash") == 0, 2.5)
        assert time.monotonic() - killed > 0.3  # it really was the TTL (1 s, refreshed ≤ 0.25 s before the kill)
        client = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            assert line.split()[1] not in await client.smembers(prefix + "gateways")  # pruned from the registry
        finally:
            await client.aclose()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
        await b.stop()


# -- outage: a Redis of our own, stopped and restarted -------------------------------------------------------------


async def test_redis_outage_routes_locally_then_resynchronises(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="m3gate.shared_state")
    url = f"redis://127.0.0.1:{private_redis.port}/7"
    got_b = Applied()
    a = _state(url, "t:", Applied(), {"http://r1": 2}, max_buffer=256, backoff_max_s=0.4)
    b = _state(url, "t:", got_b, {}, backoff_max_s=0.4)
    await a.start()
    await b.start()
    try:
        a.on_dispatch("p", "http://before", RoutingRequest(1, 1, (1,), None))
        await eventually(lambda: got_b.replicas() == ["http://before"], 1.0)
        await eventually(lambda: b.remote_in_flight("http://r1") == 2, 1.0)

        private_redis.stop()
        for i in range(5000):  # the hot path during the outage: no exception, no I/O, bounded memory
            a.on_dispatch("p", f"http://during{i}", RoutingRequest(1, 1, (i,), None))
            if i % 500 == 0:
                await asyncio.sleep(0.02)
        await eventually(lambda: not a.available and not b.available, 1.0)
        assert a.buffered <= 256 and a.counters.entries_dropped >= 5000 - 256
        assert b.remote_in_flight("http://r1") == 0  # no stale counts from an unreachable Redis
        assert await b.exchange_capacity(b"share", 1.0) is None  # the capacity signal sizes from its own demand
        await asyncio.sleep(0.5)  # several failed reconnects

        private_redis.start()
        await eventually(lambda: a.available and b.available, 3.0)
        a.on_dispatch("p", "http://after", RoutingRequest(1, 1, (2,), None))
        await eventually(lambda: "http://after" in got_b.replicas(), 1.0)
        # the newest dispatches kept during the outage were published on reconnect (resync)
        assert "http://during4999" in got_b.replicas()
        await eventually(lambda: b.remote_in_flight("http://r1") == 2, 1.0)
        await eventually(lambda: len(a._peers) == 1, 1.0)
        await b.exchange_capacity(b"share-b", 5.0)
        assert dict(await a.exchange_capacity(b"share-a", 5.0) or []) == {a.gateway_id: b"share-a",
                                                                        b.gateway_id: b"share-b"}
        assert a.counters.reconnects == b.counters.reconnects == 1
    finally:
        await a.stop()
        await b.stop()
    outage_lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage_lines) == 2  # once per gateway, not per request or per retry
