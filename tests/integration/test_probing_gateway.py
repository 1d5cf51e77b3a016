"""Probing through a real gateway in front of simulated replicas (policies/probing.py, pools/monitor.py): an idle
replica is scraped far less often than one taking requests (each visit probing /health first), and a
replica killed while idle and backed off is still found dead and taken out of rotation."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
INTERVAL_S = 0.2  # the longest backed-off period: 16 × = 3.2 s


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--speed", "50"]} for _ in range(2)]) as sims:
        yield sims


@pytest.fixture(scope="module")
def gateway(replicas: list[SimProcess]) -> Iterator[GatewayProcess]:
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [s.url for s in replicas]}],
        "server": {"health_interval_s": INTERVAL_S},
    })
    try:
        yield gw
    finally:
        gw.stop()


def _counts(sims: list[SimProcess]) -> dict[str, dict[str, int]]:
    return {s.url: s.stats()["requests"] for s in sims}


def _delta(after: dict[str, int], before: dict[str, int], path: str) -> int:
    return after.get(path, 0) - before.get(path, 0)


def _replicas(gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    return httpx.get(gateway.url + "/admin/pools", timeout=5).json()["pools"]["interactive"]["replicas"]


def _admin(gateway: GatewayProcess, what: str, url: str) -> None:
    assert httpx.post(f"{gateway.url}/admin/replicas/{what}", json={"endpoint": url}, timeout=5).status_code == 200


def test_an_idle_replica_is_scraped_less_and_a_killed_one_is_still_taken_out(
        gateway: GatewayProcess, replicas: list[SimProcess]) -> None:
    busy, idle = (s.url for s in replicas)
    _admin(gateway, "drain", idle)  # no requests for it: it stays idle
    time.sleep(16 * INTERVAL_S * 2)  # both idle since the start: backed off to the longest period
    assert _replicas(gateway)[idle]["probe_every_s"] == pytest.approx(16 * INTERVAL_S)
    before = _counts(replicas)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the same question, again"}], "max_tokens": 4}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4.0:
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.headers["x-m3gate-endpoint"] == busy
    after = _counts(replicas)
    assert _replicas(gateway)[busy]["probe_every_s"] == pytest.approx(INTERVAL_S)
    busy_scrapes = _delta(after[busy], before[busy], "/metrics")
    idle_scrapes = _delta(after[idle], before[idle], "/metrics")
    assert busy_scrapes >= 10  # every 0.2 s while it takes requests
    assert idle_scrapes <= 3 < busy_scrapes / 3  # at most once per 3.2 s
    assert _delta(after[busy], before[busy], "/health") >= busy_scrapes - 1  # /health first at every visit
    assert _delta(after[idle], before[idle], "/health") <= 3

    _admin(gateway, "undrain", idle)  # in rotation again, still idle and backed off
    dead = next(s for s in replicas if s.url == idle)
    time.sleep(16 * INTERVAL_S)
    dead.kill()
    deadline = time.monotonic() + 16 * INTERVAL_S + 3.0  # its next visit, and the probe's timeout
    while _replicas(gateway)[idle]["healthy"]:
        assert time.monotonic() < deadline, "a killed idle replica was not found dead"
        time.sleep(0.1)
    for i in range(5):  # out of rotation: every request goes to the live one
        r = httpx.post(gateway.url + "/v1/chat/completions",
                       json={**body, "messages": [{"role": "user", "content": f"another {i}"}]}, timeout=10)
        assert r.status_code == 200 and r.headers["x-m3gate-endpoint"] == busy
