"""Precise routing's Prometheus families are part of the gateway's metrics from whichever registry serves /metrics:
the one built at start and the one built when a reload turns metrics on, each exactly once."""

from __future__ import annotations

from typing import Any

from gateway.runtime import Gateway
from policies.config import GatewayConfig

MODEL = "MiniMaxAI/MiniMax-M3"
SCORED = 'm3gate_precise_replica_scorings_total{pool="p",source="exact"}'


def config(metrics: bool, precise: bool = True) -> GatewayConfig:
    pool: dict[str, Any] = {"name": "p", "max_model_len": 8192, "endpoints": ["http://10.0.0.1:8000"]}
    if precise:
        pool["precise"] = {"tokenizer": "replica", "endpoint": "tcp://*:5557"}
    return GatewayConfig.model_validate({"model": MODEL, "pools": [pool], "telemetry": {"metrics": metrics}})


def exposition(gw: Gateway) -> str:
    assert gw.telemetry.metrics is not None
    body, _ = gw.telemetry.metrics.render(None)
    return body.decode()


def test_the_precise_pools_families_are_served_once() -> None:
    gw = Gateway(config(metrics=True))
    text = exposition(gw)
    assert text.count(SCORED) == 1


def test_metrics_turned_on_by_a_reload_carry_the_precise_families() -> None:
    gw = Gateway(config(metrics=False))
    assert gw.telemetry.metrics is None
    gw.apply_config(config(metrics=True))
    assert exposition(gw).count(SCORED) == 1
    gw.apply_config(config(metrics=False))
    gw.apply_config(config(metrics=True))  # the same registry comes back: still once
    assert exposition(gw).count(SCORED) == 1


def test_a_pool_that_stops_routing_precisely_leaves_the_families() -> None:
    gw = Gateway(config(metrics=True))
    gw.apply_config(config(metrics=True, precise=False))
    assert SCORED not in exposition(gw)
