"""SLO-aware choice through a real gateway: the x-slo-* headers are checked, a pool predicted to miss a request's
TTFT objective yields to a larger pool predicted to meet it, a sheddable class gets a 429 with Retry-After when
nothing can, and every decision shows its reason and its prediction's error in /metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "stream": True}


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    args = ["--instant", "--mean-output-tokens", "4"]
    with running_sims([{"max_model_len": 8192, "extra_args": args},
                       {"max_model_len": 65536, "extra_args": args}]) as procs:
        yield procs


@pytest.fixture(scope="module")
def gateway(sims: list[SimProcess]) -> Iterator[GatewayProcess]:
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "small", "max_model_len": 8192, "endpoints": [sims[0].url]},
                  {"name": "large", "max_model_len": 65536, "endpoints": [sims[1].url]}],
        "server": {"health_interval_s": 0.5},
        "traffic": {"classes": {
            "interactive": {"priority": 0, "ttft_target_s": 1.0},
            "batch": {"priority": 1, "sheddable": True, "ttft_target_s": 5.0},
        }, "pool_classes": {"small": "interactive", "large": "interactive"}},
    })
    try:
        yield gw
    finally:
        gw.stop()


def _metrics(gw: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _reason(gw: GatewayProcess, pool: str, reason: str) -> float:
    return _metrics(gw).get(("m3gate_routing_decisions_total", (("pool", pool), ("reason", reason))), 0.0)


def _stream(gw: GatewayProcess, headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=CHAT, headers=headers, timeout=30) as r:
        r.read()
        return r


def test_bad_slo_headers_are_the_callers_to_fix(gateway: GatewayProcess) -> None:
    r = httpx.post(gateway.base_url + "/chat/completions", json=CHAT, headers={"x-slo-ttft-ms": "soon"}, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "x-slo-ttft-ms" and error["code"] == "invalid_header" and "milliseconds" in error["message"]


def test_a_slow_pool_yields_to_a_larger_one_predicted_to_meet_the_objective(
    gateway: GatewayProcess, sims: list[SimProcess]
) -> None:
    sims[0].set_faults(added_latency_ms=600)  # the small pool answers slowly: its TTFT estimate learns it
    try:
        for _ in range(8):
            assert _stream(gateway).headers["x-m3gate-pool"] == "small"
        # the small pool's engine cost model learnt the slowness from the first tokens (operators see it)
        model = httpx.get(gateway.url + "/admin/pools", timeout=5).json()["pools"]["small"]["latency_model"]
        assert model["cost"]["samples"] >= 8 and model["cost"]["step_s"] > 0.3, model
        before = _reason(gateway, "large", "slo_spill")
        r = _stream(gateway, {"x-slo-ttft-ms": "300"})
        assert r.status_code == 200 and r.headers["x-m3gate-pool"] == "large"
        assert _reason(gateway, "large", "slo_spill") == before + 1
        relaxed = _stream(gateway, {"x-slo-ttft-ms": "60000"})  # the small pool meets a relaxed objective: stays
        assert relaxed.headers["x-m3gate-pool"] == "small"
        metrics = _metrics(gateway)
        assert metrics[("m3gate_ttft_prediction_ratio_count", (("pool", "small"),))] >= 9
        covered = sum(v for (name, labels), v in metrics.items()
                      if name == "m3gate_ttft_p90_covered_total" and ("pool", "small") in labels)
        assert covered >= 9
    finally:
        sims[0].set_faults(added_latency_ms=0)


def test_nothing_meets_it_sheddable_gets_429_the_rest_is_served_as_an_expected_miss(gateway: GatewayProcess) -> None:
    shed = httpx.post(gateway.base_url + "/chat/completions", json=CHAT, timeout=10,
                      headers={"x-slo-ttft-ms": "0.001", "x-m3gate-class": "batch"})
    assert shed.status_code == 429 and shed.json()["error"]["code"] == "slo_unattainable"
    assert int(shed.headers["retry-after"]) >= 1
    before = sum(_reason(gateway, pool, "slo_expected_miss") for pool in ("small", "large"))
    served = _stream(gateway, {"x-slo-ttft-ms": "0.001"})
    assert served.status_code == 200
    time.sleep(0.05)
    assert sum(_reason(gateway, pool, "slo_expected_miss") for pool in ("small", "large")) == before + 1
