"""Session-fair ordering through a real gateway in front of a simulated replica, one request upstream at a time
(the class's max_concurrency: 1): one heavy session sends eight requests at once, then four light sessions one
each. With `fairness: session` the light sessions are served before the heavy session's backlog; with
`fairness: key` (order by arrival within the key) they wait behind all of it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.cli.launcher import start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--mean-output-tokens", "0"]}]) as sims:
        yield sims[0]


def _wait_until_admitted(gw_url: str, count: int, ended: list[tuple[float, str]]) -> None:
    """Until the gateway has taken `count` requests (in flight, waiting or answered): thread start-up on a busy
    machine must not let a light session overtake a heavy request that had not yet reached the gateway."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pools = httpx.get(gw_url + "/admin/traffic", timeout=5).json()["pools"]  # a pool's gate: from its 1st request
        classes = pools.get("interactive", {}).get("classes", {})
        seen = classes.get("interactive", {})
        if seen.get("in_flight", 0) + seen.get("queued", 0) + len(ended) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"the gateway did not take {count} requests within 10 s")


def _served_order(sim: SimProcess, fairness: str) -> tuple[list[str], int]:
    """Which session each answer went to, in the order the answers were admitted (one slot: the order they end),
    and how many heavy requests had gone upstream by the time the light sessions had all arrived."""
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [sim.url]}],
        "server": {"health_interval_s": 0.3},
        "traffic": {"classes": {"interactive": {"max_concurrency": 1, "queue_length": 64, "max_queue_wait_s": 60,
                                                "spill_upward": False, "fairness": fairness}}},
    })
    ended: list[tuple[float, str]] = []
    lock = threading.Lock()

    def ask(session: str, i: int) -> None:
        body = {"model": MODEL, "max_tokens": 24,
                "messages": [{"role": "user", "content": f"{session} request {i}: " + "word " * 200}]}
        resp = httpx.post(gw.base_url + "/chat/completions", json=body, headers={"x-session-id": session}, timeout=60)
        assert resp.status_code == 200, resp.text
        with lock:
            ended.append((time.monotonic(), session))

    try:
        threads = [threading.Thread(target=ask, args=("heavy", i)) for i in range(8)]
        for t in threads:
            t.start()
        _wait_until_admitted(gw.url, 8, ended)  # the heavy burst is in: one upstream, seven waiting
        lights = [threading.Thread(target=ask, args=(f"light-{i}", 0)) for i in range(4)]
        for t in lights:
            t.start()
        arrived = time.monotonic()
        for t in threads + lights:
            t.join(60)
        traffic = httpx.get(gw.url + "/admin/traffic", timeout=5).json()  # open to loopback without an admin key
        assert traffic["sessions_served"] == 5  # the heavy one and the four light ones, by their x-session-id
        assert traffic["classes"]["interactive"]["fairness"] == fairness
    finally:
        gw.stop()
    upstream = 1 + sum(1 for at, _ in ended if at < arrived)  # those ended, and the one in flight
    return [session for _, session in sorted(ended)], upstream


def test_light_sessions_are_served_before_a_heavy_sessions_backlog(sim: SimProcess) -> None:
    order, upstream = _served_order(sim, "session")
    assert len(order) == 12 and upstream <= 3
    assert order[:upstream] == ["heavy"] * upstream  # upstream before the light sessions came
    assert sorted(order[upstream:upstream + 4]) == [f"light-{i}" for i in range(4)]
    assert order[upstream + 4:] == ["heavy"] * (8 - upstream)


def test_by_key_the_light_sessions_wait_behind_the_backlog(sim: SimProcess) -> None:
    order, _ = _served_order(sim, "key")
    assert order[:8] == ["heavy"] * 8
    assert sorted(order[8:]) == [f"light-{i}" for i in range(4)]
