"""gateway/capacity/signal.py with other gateways' demand shares (what `state: redis` brings it): two gateways that each
saw part of the traffic, uneven, size the pools exactly as one gateway that saw all of it, and publish the same figure;
a gateway that joins running ones starts from their signal instead of measuring a window first."""

from __future__ import annotations

import httpx
import pytest

from gateway.app import build_app
from gateway.record import RequestRecord
from policies.config import GatewayConfig
from policies.demand_share import DemandShare, decode, encode

MODEL = "MiniMaxAI/MiniMax-M3"
CONFIG = {
    "model": MODEL,
    "pools": [{"name": "chat", "max_model_len": 32768, "kv_blocks": 4000,
               "endpoints": ["http://127.0.0.1:9", "http://127.0.0.1:10"],
               "capacity": {"min_replicas": 1, "max_replicas": 40}}],
    "traffic": {"classes": {"interactive": {"targets": {"ttft_ms": {"p95": 1000}, "tpot_ms": {"p95": 50}}},
                            "batch": {"priority": 1, "targets": {"ttft_ms": {"p95": 8000}}}},
                "pool_classes": {"chat": "interactive"}},
    "capacity": {"window_s": 10, "scale_down_stabilization_s": 30, "startup_s": 0, "interval_s": 1},
}


def _record(cls: str, at: float, prompt: int, cached: int, output: int) -> RequestRecord:
    return RequestRecord(
        api="chat", stream=True, t_arrival=at, pool="chat", replica="http://127.0.0.1:9", traffic_class=cls,
        status=200, prompt_tokens_est=prompt, t_sent=at, t_first_byte=at + 0.2, t_last_byte=at + 0.2 + 0.02 * output,
        usage={"prompt_tokens": prompt, "completion_tokens": output,
               "prompt_tokens_details": {"cached_tokens": cached}})


def _gateway():  # type: ignore[no-untyped-def]
    return build_app(GatewayConfig.model_validate(CONFIG)).state.gateway


def _exchange(now: float, gateways: dict[str, object]) -> None:
    """One tick of every gateway, each sized from its own share and the others' (through the wire format)."""
    shares = {name: encode(gw.capacity.measure(now)) for name, gw in gateways.items()}  # type: ignore[attr-defined]
    for name, gw in gateways.items():
        peers = [(other, decode(blob)) for other, blob in shares.items() if other != name]
        gw.capacity.size_pools(now, decode(shares[name]), peers)  # type: ignore[attr-defined]


def _send(gw, cls: str, at: float, i: int) -> None:  # type: ignore[no-untyped-def]
    prompt, cached, output = (4000 + 40 * (i % 7), 2500, 300 + i % 5) if cls == "interactive" else (30_000, 0, 900)
    gw.capacity.observe(_record(cls, at, prompt, cached, output))


def test_two_gateways_with_uneven_traffic_size_like_one_that_saw_it_all() -> None:
    one, a, b = _gateway(), _gateway(), _gateway()
    t0 = one.clock()
    for second in range(14):
        rate = 16 if second < 8 else 40  # a rise: the signal goes up on all of them alike
        for i in range(rate):
            at = t0 + second + i / rate
            cls = "batch" if i % 8 == 0 else "interactive"
            _send(one, cls, at, i)
            _send(a if i % 4 else b, cls, at, i)  # three quarters through a
        now = t0 + second + 1
        one.capacity.tick(now)
        _exchange(now, {"a": a, "b": b})
    key = ("chat", "both")
    alone, ea, eb = one.capacity.entries[key], a.capacity.entries[key], b.capacity.entries[key]
    assert ea["desired"] == eb["desired"] == alone["desired"] > 1, (ea, alone)
    assert ea["needed_now"] == eb["needed_now"] == alone["needed_now"]
    assert ea["demand"] == eb["demand"] == alone["demand"]
    # the window (10 s): 6 s at 35 interactive requests a second, 4 s at 14
    assert ea["demand"]["interactive"]["rate_per_s"] == pytest.approx((6 * 35 + 4 * 14) / 10, rel=0.02)
    # each one's own share is the part it saw; the signal rests on both
    local_a, local_b = ({cls: v["rate_per_s"] for cls, v in gw.capacity.view()["local_demand"]["chat"].items()}
                        for gw in (a, b))
    assert sum(local_a.values()) == pytest.approx(3 * sum(local_b.values()), rel=0.01)
    for cls in ("interactive", "batch"):
        assert local_a.get(cls, 0) + local_b[cls] == pytest.approx(ea["demand"][cls]["rate_per_s"], abs=1e-3)
    view = a.capacity.view()
    assert (view["demand_source"], view["demand_gateways"]) == ("shared", 2)
    assert (one.capacity.view()["demand_source"], one.capacity.view()["demand_gateways"]) == ("local", 1)


def test_the_learnt_costs_are_merged_so_both_gateways_use_the_same() -> None:
    a, b = _gateway(), _gateway()
    t0 = a.clock()
    for i in range(300):  # only a sees streams: b's decode cost is the default, a's is learnt
        _send(a, "interactive", t0 + i / 30, i)
    assert a.capacity.decode_costs["chat"].samples == 300 and "chat" not in b.capacity.decode_costs
    _exchange(t0 + 10, {"a": a, "b": b})
    costs_a, costs_b = a.capacity.entries[("chat", "both")]["costs"], b.capacity.entries[("chat", "both")]["costs"]
    assert costs_a == costs_b
    learnt = a.capacity.decode_costs["chat"].coef[0]
    assert costs_a["decode_step_s"] == pytest.approx(learnt, abs=1e-5)  # b had nothing to weigh in


def test_a_gateway_joining_running_ones_starts_from_their_signal_and_falls_with_it() -> None:
    a = _gateway()
    t0 = a.clock()
    for second in range(12):  # a runs through its first window under load
        for i in range(30):
            _send(a, "interactive", t0 + second + i / 30, i)
        a.capacity.tick(t0 + second + 1)
    high = a.capacity.entries[("chat", "both")]["desired"]
    assert high > 1
    b = _gateway()  # joins when the load has gone: alone it would measure a window, then ask for 1
    now = t0 + 12
    for step in range(120):
        now = t0 + 13 + step
        _exchange(now, {"a": a, "b": b})
        ea, eb = a.capacity.entries[("chat", "both")], b.capacity.entries[("chat", "both")]
        assert eb["desired"] == ea["desired"], (step, ea["desired"], eb["desired"])
    assert ea["desired"] == 1  # both fell, together, once the stabilization window passed


@pytest.mark.asyncio
async def test_without_peers_nothing_changes_and_the_view_says_local() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    gw = app.state.gateway
    assert await gw.shared.exchange_capacity(b"{}", 1.0) is None  # memory state: nobody to share with
    t0 = gw.clock()
    for second in range(12):
        for i in range(8):
            _send(gw, "interactive", t0 + second + i / 8, i)
        gw.capacity.tick(t0 + second + 1)
    assert isinstance(gw.capacity.local, DemandShare)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        body = (await client.get("/admin/capacity")).json()
    assert (body["demand_source"], body["demand_gateways"]) == ("local", 1)
    assert body["local_demand"]["chat"]["interactive"]["rate_per_s"] == \
        body["pools"]["chat"]["both"]["demand"]["interactive"]["rate_per_s"] == pytest.approx(8.0, rel=0.1)
