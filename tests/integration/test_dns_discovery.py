"""A pool found through DNS (a headless Service in Kubernetes): replicas appear and disappear under load, with a
stub resolver standing in for the cluster DNS and real simulated replicas on distinct loopback addresses."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import build_app
from gateway.cli.launcher import free_port
from policies.config import GatewayConfig
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"


class StubDns:
    """Answers like loop.getaddrinfo for one name; the test edits `addresses`, or makes lookups fail."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.failing = False

    async def __call__(self, host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if self.failing:
            raise socket.gaierror("stub DNS is down")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in self.addresses]


@pytest.fixture
async def stack() -> AsyncIterator[tuple[str, StubDns, dict[str, SimProcess]]]:
    port = free_port()
    sims = {addr: start_sim(8192, extra_args=["--instant", "--host", addr], port=port)
            for addr in ("127.0.0.2", "127.0.0.3")}
    dns = StubDns()
    dns.addresses = ["127.0.0.2"]
    config = GatewayConfig.model_validate({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192,
                   "discovery": {"dns_name": "pool.m3.svc.cluster.local", "port": port, "refresh_s": 0.1}}],
        "server": {"health_interval_s": 0.2},
    })
    gw_port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(config, resolver=dns), host="127.0.0.1", port=gw_port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{gw_port}", dns, sims
    finally:
        server.should_exit = True
        await task
        for sim in sims.values():
            sim.stop()


async def test_replicas_appear_and_disappear_under_load(stack: tuple[str, StubDns, dict[str, SimProcess]]) -> None:
    url, dns, sims = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    served: list[str] = []
    failures: list[int] = []

    async def load(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            resp = await client.post(url + "/v1/chat/completions", json=body)
            if resp.status_code != 200:
                failures.append(resp.status_code)
            else:
                served.append(resp.headers["x-m3gate-endpoint"])

    async def phase(seconds: float) -> set[str]:
        start = len(served)
        await asyncio.sleep(seconds)
        return set(served[start:])

    async with httpx.AsyncClient(timeout=10) as client:
        stop = asyncio.Event()
        workers = [asyncio.create_task(load(client, stop)) for _ in range(4)]
        try:
            first = await phase(0.6)
            dns.addresses = ["127.0.0.2", "127.0.0.3"]  # scale out
            await asyncio.sleep(0.4)
            both = await phase(1.0)
            dns.failing = True  # a DNS outage keeps the last good set
            during_outage = await phase(0.6)
            dns.failing = False
            dns.addresses = ["127.0.0.3"]  # scale in: .2 goes away
            await asyncio.sleep(0.4)
            after = await phase(0.8)
        finally:
            stop.set()
            await asyncio.gather(*workers)
    a, b = (f"http://127.0.0.{n}:{sims['127.0.0.2'].port}" for n in (2, 3))
    assert first == {a}
    assert both == {a, b}
    assert during_outage == {a, b}
    assert after == {b}
    assert failures == []
