"""The status page's history (gateway/observability/history.py) and how the page learns whether it needs a key
(GET /ui/access)."""

from __future__ import annotations

import time
from bisect import bisect_left

import pytest
from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.observability.history import History
from gateway.runtime import Gateway
from policies.config import GatewayConfig
from policies.contract import histogram_quantile

TTFT_KEY = ("chat", "short", "interactive", "adaptive")  # (api, pool, class, thinking_mode)
TPOT_KEY = ("short", "interactive", "adaptive")  # (pool, class, thinking_mode)
KEY = "k" * 20


def config(admin: dict | None = None) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "model": "m", "admin": admin or {},
        "pools": [{"name": "short", "max_model_len": 32768,
                   "endpoints": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]},
                  {"name": "long", "max_model_len": 1048576, "endpoints": ["http://127.0.0.1:9003"]}],
        "traffic": {"classes": {"interactive": {"priority": 0}, "extended": {"priority": 2}}},
    })


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def gw() -> Gateway:
    gateway = build_app(config()).state.gateway
    gateway.clock = Clock()
    return gateway


def expected_p95_ms(bounds: tuple[float, ...], values: list[float]) -> float:
    """What a histogram holding only `values` says its p95 is, built here bucket by bucket."""
    counts = [0.0] * (len(bounds) + 2)
    for v in values:
        counts[bisect_left(bounds, v)] += 1
    return round(histogram_quantile(0.95, bounds, counts) * 1000, 2)


def test_the_ring_is_bounded_and_keeps_the_newest_points(gw: Gateway) -> None:
    walls = iter(range(100, 200))
    history = History(gw, size=4, wall=lambda: float(next(walls)))
    for _ in range(10):
        history.sample()
        gw.clock.t += 5
    assert [p["t"] for p in history.points] == [106.0, 107.0, 108.0, 109.0]
    assert history.points.maxlen == 4
    assert [p["t"] for p in history.since(107.0)] == [108.0, 109.0]
    assert len(history.since(None)) == 4
    assert history.view(108.0)["points"] == [history.points[-1]]


def test_each_point_takes_the_p95_of_the_trailing_window_only(gw: Gateway) -> None:
    req = gw.telemetry.metrics.requests
    history = History(gw, every_s=5.0, trailing_s=10.0)  # each point: the 10 s before it
    fast, slow = [0.05] * 100, [2.0] * 40 + [0.3] * 60
    for v in fast:
        req.ttft.observe(TTFT_KEY, v)
    first = history.sample()["classes"]["interactive"]
    assert first["ttft_p95_ms"] == expected_p95_ms(req.ttft.bounds, fast)  # since the start: all of them
    gw.clock.t += 5
    for v in slow:
        req.ttft.observe(TTFT_KEY, v)
        req.tpot.observe(TPOT_KEY, v / 100)
        req.e2e.observe(TTFT_KEY, v)
    second = history.sample()["classes"]["interactive"]
    # the fast ones are older than the window's baseline: only the slow ones count
    assert second["ttft_p95_ms"] == expected_p95_ms(req.ttft.bounds, slow)
    assert second["ttft_p95_ms"] > 1000 > first["ttft_p95_ms"]
    assert second["tpot_p95_ms"] == expected_p95_ms(req.tpot.bounds, [v / 100 for v in slow])
    assert second["admitted_per_s"] == pytest.approx(len(slow) / 5.0)
    gw.clock.t += 5
    third = history.sample()["classes"]["interactive"]  # 10 s window: the slow ones still in it
    assert third["ttft_p95_ms"] == second["ttft_p95_ms"] and third["admitted_per_s"] == pytest.approx(len(slow) / 10)
    gw.clock.t += 5
    fourth = history.sample()["classes"]["interactive"]  # nothing new in the last 10 s
    assert fourth["ttft_p95_ms"] is None and fourth["admitted_per_s"] == 0.0


def test_the_tables_baseline_is_the_oldest_snapshot_of_the_last_five_minutes(gw: Gateway) -> None:
    history = History(gw, every_s=5.0, trailing_s=10.0, table_window_s=20.0)  # 5 snapshots kept
    assert history.baseline(gw.clock()) is None  # before the first sample: the page counts since the start
    taken = []
    for _ in range(8):
        history.sample()
        taken.append(gw.clock.t)
        gw.clock.t += 5
    assert history.baseline(gw.clock())[0] == taken[-5]  # 20 s back from the newest
    assert history.baseline(taken[-5]) is None  # nothing older than that moment


def test_pools_show_in_flight_and_kv_use(gw: Gateway) -> None:
    replicas = list(gw.pools["short"].replicas.values())
    replicas[0].in_flight, replicas[1].in_flight = 3, 2
    point = History(gw).sample()
    assert point["pools"]["short"]["in_flight"] == 5
    assert point["pools"]["long"]["in_flight"] == 0
    assert point["pools"]["short"]["kv_use"] is None  # never scraped: unknown, not zero


def test_the_app_samples_while_it_runs_and_the_page_gets_only_new_points() -> None:
    app = build_app(config())
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        history = app.state.history
        deadline = time.monotonic() + 5
        while not history.points and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(history.points) == 1  # the sampler's first point, taken at start (the next one in 5 s)
        history.sample()
        state = client.get("/ui/state").json()["history"]
        assert state["every_s"] == 5.0 and state["size"] == 180 and len(state["points"]) == 2
        newest = state["points"][-1]["t"]
        assert client.get(f"/ui/state?history_since={newest}").json()["history"]["points"] == []
        bad = client.get("/ui/state?history_since=yesterday")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "history_since"


def test_ui_access_says_whether_a_key_is_needed_without_refusing() -> None:
    keyed = build_app(config({"api_key": KEY}))
    client = TestClient(keyed, client=("127.0.0.1", 5000))
    assert client.get("/ui/access").json() == {"key_needed": True, "allowed": False, "message": None}
    wrong = client.get("/ui/access", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 200 and wrong.json()["allowed"] is False and wrong.json()["message"]
    assert client.get("/ui/access", headers={"authorization": f"Bearer {KEY}"}).json()["allowed"] is True

    open_here = build_app(config({"api_key": KEY, "ui_open_on_loopback": True}))
    assert TestClient(open_here, client=("127.0.0.1", 5000)).get("/ui/access").json()["key_needed"] is False
    assert TestClient(open_here, client=("10.1.2.3", 5000)).get("/ui/access").json()["key_needed"] is True

    no_key = build_app(config())  # loopback only, like /admin
    assert TestClient(no_key, client=("127.0.0.1", 5000)).get("/ui/access").json() == {
        "key_needed": False, "allowed": True, "message": None}
    far = TestClient(no_key, client=("10.1.2.3", 5000)).get("/ui/access")
    assert far.status_code == 200 and far.json()["allowed"] is False and "loopback" in far.json()["message"]

    off = build_app(config({"ui": False}))
    assert TestClient(off).get("/ui/access").status_code == 404
