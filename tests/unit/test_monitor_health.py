"""The replica monitor's health rule: a refused connection or a non-200 /health marks a replica unhealthy at once; a
timed-out probe only when it is the second in a row (a gateway whose event loop lags on a busy machine would
otherwise fail every probe at once and leave its pool with no replica), and an answer in between resets the count."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gateway.cli.launcher import free_port
from pools.monitor import TIMEOUTS_TO_UNHEALTHY, ReplicaMonitor
from pools.replicas import Replica


class SlowHealth:
    """/health that answers 200 after `delay_s`, or `status` at once."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.status = 200

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")


async def _serve(fake: SlowHealth) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_get("/metrics", fake.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def test_timeouts_count_only_in_a_row_and_errors_at_once() -> None:
    assert TIMEOUTS_TO_UNHEALTHY == 2

    async def run() -> None:
        fake = SlowHealth()
        runner, port = await _serve(fake)
        replica = Replica(url=f"http://127.0.0.1:{port}", pool="p")
        try:
            async with aiohttp.ClientSession() as session:
                monitor = ReplicaMonitor(session, lambda: [replica], interval_s=0.1)  # probe timeout: 0.5 s
                await monitor.poll_once()
                assert replica.healthy
                fake.delay_s = 1.0
                await monitor.poll_once()
                assert replica.healthy  # one timeout: not yet
                fake.delay_s = 0.0
                await monitor.poll_once()  # an answer resets the count
                fake.delay_s = 1.0
                await monitor.poll_once()
                assert replica.healthy
                await monitor.poll_once()
                assert not replica.healthy  # the second in a row
                fake.delay_s = 0.0
                await monitor.poll_once()
                assert replica.healthy
                fake.status = 500
                await monitor.poll_once()
                assert not replica.healthy  # an error answer: at once
                fake.status = 200
                await monitor.poll_once()
                assert replica.healthy
        finally:
            await runner.cleanup()
        refused = Replica(url=f"http://127.0.0.1:{free_port()}", pool="p")
        async with aiohttp.ClientSession() as session:
            await ReplicaMonitor(session, lambda: [refused], interval_s=0.1).poll_once()
        assert not refused.healthy  # nothing listens: at once

    asyncio.run(run())
