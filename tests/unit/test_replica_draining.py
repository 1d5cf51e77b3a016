"""A replica that shuts down is drained, not ejected: no new requests (`is_available`, the snapshot policies read),
no failure counted, and back in rotation as soon as the monitor sees it take requests again. The monitor runs
against a real HTTP server over loopback that answers as vLLM 0.32 does while it shuts down (/health 200, /tokenize
500 "cannot schedule new futures after shutdown") and after a restart."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from policies.config import PoolConfig
from pools.monitor import ReplicaMonitor
from pools.replicas import PoolRuntime, Replica

REFUSAL = {"error": {"message": "cannot schedule new futures after shutdown", "type": "InternalServerError",
                     "param": None, "code": 500}}


def test_a_shutting_down_replica_takes_no_new_requests_and_is_not_ejected() -> None:
    replica = Replica(url="http://a", pool="p")
    replica.record_failure(10.0, answered=True)  # one earlier 5xx
    replica.start_draining("refused a request (shutting down)")
    replica.start_draining("connection refused")  # the first reason stays; counted once
    assert not replica.is_available(100.0)
    snap = replica.snapshot(100.0)
    assert snap.draining and snap.healthy  # policies filter it as draining; it is not a failed replica
    assert replica.ejections == 0 and replica.drains == 1
    assert replica.drain_state == "refused a request (shutting down)"
    replica.stop_draining()
    assert replica.is_available(100.0) and replica.consecutive_failures == 0 and replica.drain_state is None


def test_stop_draining_lifts_an_ejection_from_while_it_was_down() -> None:
    replica = Replica(url="http://a", pool="p")
    for _ in range(4):
        replica.record_failure(0.0)  # connection errors while it restarted: ejected for 8 s
    replica.start_draining("connection refused")
    replica.stop_draining()
    assert replica.is_available(0.5)


def test_admin_drain_and_shutdown_are_told_apart() -> None:
    replica = Replica(url="http://a", pool="p", draining=True)
    assert replica.drain_state == "admin" and not replica.is_available(0.0)


def test_the_pool_has_no_available_replica_when_its_only_one_shuts_down() -> None:
    pool = PoolRuntime.from_config(PoolConfig.model_validate({"name": "p", "max_model_len": 1024,
                                                              "endpoints": ["http://a"]}))
    assert pool.available(0.0)
    pool.replicas["http://a"].start_draining("connection refused")
    assert not pool.available(0.0)


class FakeVllm:
    """/health and /tokenize as a vLLM server in one of its states."""

    def __init__(self) -> None:
        self.state = "serving"  # serving | shutting_down | engine_dead
        self.tokenize_calls = 0

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.state == "engine_dead" else 200)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_calls += 1
        if self.state != "serving":
            return web.json_response(REFUSAL, status=500)
        body: dict[str, Any] = await request.json()
        return web.json_response({"count": len(body["prompt"].split()), "tokens": [1, 2, 3], "max_model_len": 1024})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def serve(self) -> tuple[web.AppRunner, int]:
        """Listening on a free loopback port: the runner (to clean up) and the port."""
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["shutting_down", "engine_dead"])
def test_the_monitor_keeps_a_replica_drained_until_it_takes_requests_again(how: str) -> None:
    async def run() -> None:
        fake = FakeVllm()
        runner, port = await fake.serve()
        replica = Replica(url=f"http://127.0.0.1:{port}", pool="p")
        try:
            async with aiohttp.ClientSession() as session:
                monitor = ReplicaMonitor(session, lambda: [replica], interval_s=0.1)
                await monitor.poll_once()
                assert replica.is_available(0.0) and fake.tokenize_calls == 0  # no probe while it serves
                fake.state = how
                if how == "shutting_down":  # /health stays 200: only its refusal of a request tells
                    replica.start_draining("refused a request (shutting down)")
                for _ in range(3):
                    await monitor.poll_once()
                    assert not replica.is_available(0.0) and replica.drain_state is not None
                assert fake.tokenize_calls == (3 if how == "shutting_down" else 0)  # probed only while /health is 200
                fake.state = "serving"  # a new process at the same URL
                await monitor.poll_once()
                assert replica.is_available(0.0) and replica.drain_state is None and replica.healthy
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_the_tokenize_proxy_drains_a_replica_that_refuses_connections_and_asks_the_next() -> None:
    """POST /tokenize through the gateway: a replica whose port refuses the connection (a restart, a stop) is drained,
    not ejected as failed, and the next replica answers."""
    import httpx

    from gateway.app import build_app
    from gateway.cli.launcher import free_port
    from policies.config import GatewayConfig

    async def run() -> None:
        fake = FakeVllm()
        runner, port = await fake.serve()
        closed = f"http://127.0.0.1:{free_port()}"
        config = GatewayConfig.model_validate({"model": "m", "pools": [
            {"name": "chat", "max_model_len": 32768, "endpoints": [closed, f"http://127.0.0.1:{port}"]}]})
        gateway_app = build_app(config)
        gw = gateway_app.state.gateway
        try:
            async with aiohttp.ClientSession() as session:
                gw.session = session
                transport = httpx.ASGITransport(app=gateway_app, client=("127.0.0.1", 4000))
                async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                    resp = await client.post("/tokenize", json={"model": "m", "prompt": "one two three"})
            assert resp.status_code == 200 and resp.json()["count"] == 3
            assert resp.headers["x-m3gate-endpoint"] == f"http://127.0.0.1:{port}"
            refused = gw.pools["chat"].replicas[closed]
            assert refused.drain_state is not None and refused.consecutive_failures == 0
            assert gw.clock() >= refused.ejected_until  # not ejected: back as soon as a probe finds it serving
        finally:
            gw.session = None
            await runner.cleanup()

    asyncio.run(run())
