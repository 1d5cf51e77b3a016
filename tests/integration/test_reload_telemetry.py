"""A real `m3gate serve`, reloaded through its file and `POST /admin/reload`: the /metrics series of the pool and
replicas the reload removed are gone at the next scrape while the others go on, and changed telemetry settings apply
at once: tracing turned on (console exporter: the next request's spans appear in the gateway's output), metrics
turned off (404) and on again (counters go on)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
TRACE_ID = "7bf92f3577b34da6a3ce929d0e0e4739"


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--speed", "20"]} for _ in range(3)]) as s:
        yield s


def config(interactive: list[str], long: list[str] | None = None, **telemetry: Any) -> dict[str, Any]:
    pools = [{"name": "interactive", "max_model_len": 8192, "endpoints": interactive}]
    if long:
        pools.append({"name": "long", "max_model_len": 16384, "endpoints": long})
    return {
        "model": MODEL,
        "pools": pools,
        "routing": {"policy": "round_robin"},
        "server": {"health_interval_s": 0.3},
        "admin": {"watch_config": False},
        "telemetry": telemetry or {"metrics": True},
    }


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(gw: GatewayProcess) -> Samples:
    resp = httpx.get(gw.url + "/metrics", timeout=10)
    resp.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def label_values(samples: Samples, label: str) -> set[str]:
    return {v for _, labels in samples for k, v in labels if k == label}


def reload(gw: GatewayProcess, cfg: dict[str, Any]) -> None:
    gw.write_config(cfg)
    resp = httpx.post(gw.url + "/admin/reload", timeout=10)
    assert resp.status_code == 200 and resp.json()["ok"], resp.text


def chat(client: httpx.Client, pool: str | None = None, headers: dict[str, str] | None = None) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "stream": True,
            "chat_template_kwargs": {"thinking_mode": "disabled"}}
    extra = {"x-m3gate-pool": pool} if pool else {}
    resp = client.post("/chat/completions", json=body, headers={**extra, **(headers or {})})
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n"), resp.text[-300:]


def test_a_reload_drops_the_series_of_what_it_removed_and_applies_telemetry(sims: list[SimProcess]) -> None:
    a, b, c = (s.url for s in sims)
    gw = start_gateway(config([a, b], long=[c]), env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        with httpx.Client(base_url=gw.base_url, timeout=30) as client:
            for _ in range(4):  # round robin: both interactive replicas answer
                chat(client)
            chat(client, pool="long")
            before = scrape(gw)
            assert {"interactive", "long"} <= label_values(before, "pool")
            assert {a, b, c} <= label_values(before, "endpoint")
            served = {e: before.get(("m3gate_upstream_requests_total", (("endpoint", e), ("pool", "interactive"),
                                                                       ("status", "200"))), 0.0) for e in (a, b)}
            assert served[a] > 0 and served[b] > 0, served
            requests = ("m3gate_requests_total", (("api", "chat"), ("class", "interactive"), ("pool", "interactive"),
                                                  ("status", "200"), ("thinking_mode", "disabled")))
            assert before[requests] == 4

            # 1. the long pool and replica b go; tracing comes on (console: spans are printed to the gateway's log)
            reload(gw, config([a], metrics=True, tracing={"enabled": True, "exporter": "console"}))
            after = scrape(gw)
            assert "long" not in label_values(after, "pool")
            assert label_values(after, "endpoint") & {b, c} == set(), sorted(
                (name, labels) for name, labels in after if dict(labels).get("endpoint") in (b, c))
            assert after[requests] == 4  # what stays, stays
            assert ("m3gate_replica_healthy", (("endpoint", a), ("pool", "interactive"))) in after
            itl = ("m3gate_inter_token_latency_seconds_count", (("class", "interactive"), ("pool", "interactive"),
                                                                 ("thinking_mode", "disabled")))
            assert after[itl] > 0

            chat(client, headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
            deadline = time.monotonic() + 10
            while TRACE_ID not in gw.log_path.read_text(errors="replace"):
                assert time.monotonic() < deadline, f"no span of the traced request in the log:\n{gw.log_tail()}"
                time.sleep(0.1)
            spans = gw.log_path.read_text(errors="replace").count(f'"trace_id": "0x{TRACE_ID}"')
            assert spans == 4, gw.log_tail()  # server, attempt, prefill, decode

            # 2. metrics off: /metrics answers 404; on again: the same counters go on
            reload(gw, config([a], metrics=False))
            assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 404
            chat(client)
            reload(gw, config([a], metrics=True))
            chat(client)
            again = scrape(gw)
            assert again[requests] == 4 + 1 + 1  # the traced one and the last; not the one while metrics were off
            in_flight = ("m3gate_requests_in_flight", (("api", "chat"),))
            assert again[in_flight] == 0
    finally:
        gw.stop()
