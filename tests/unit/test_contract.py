"""The operating contract (policies/contract.py), the per-class targets in the config, the status page's data."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.cli.contract import BOUNDS
from gateway.record import RequestRecord
from gateway.observability.recent import RecentRequests
from policies.config import GatewayConfig
from policies.contract import (
    build_contract, check, histogram_quantile, observed_from_samples, passed, sli_bound, slo_rules, to_html,
    to_markdown,
)


def config(admin: dict | None = None, **classes: dict) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "admin": admin or {},
        "model": "m",
        "pools": [
            {"name": "short", "max_model_len": 32768, "endpoints": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"],
             "kv_blocks": 1000},
            {"name": "long", "max_model_len": 1048576, "endpoints": ["http://127.0.0.1:9003"],
             "launch": {"hardware": "b200", "variant": "nvfp4", "speculative_decoding": True, "replicas": 3}},
        ],
        "traffic": {"classes": classes or {"interactive": {"priority": 0}, "extended": {"priority": 2}}},
    })


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert histogram_quantile(0.5, bounds, [0, 10, 0, 0, 99.0]) == pytest.approx(0.15)
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 5]) == 0.4  # in +Inf: the last bound
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_targets_validate_and_fall_back_to_the_ttft_target() -> None:
    cfg = config(a={"ttft_target_s": 0.5}, b={"targets": {"ttft_ms": {"p50": 100, "p99": 900}, "tpot_ms": {"p95": 40}}})
    assert cfg.traffic.classes["a"].latency_targets() == {"ttft": [("p95", 500.0)], "tpot": [], "e2e": []}
    assert cfg.traffic.classes["b"].latency_targets()["ttft"] == [("p50", 100.0), ("p99", 900.0)]
    with pytest.raises(Exception, match="percentiles only grow"):
        config(a={"targets": {"ttft_ms": {"p50": 500, "p95": 100}}})


def test_the_contract_names_capacity_precision_and_kernel_path() -> None:
    contract = build_contract(config(interactive={"priority": 0}, extended={"priority": 2}))
    by_name = {c.name: c for c in contract.classes}
    assert by_name["interactive"].context_ceiling == 32768 and by_name["interactive"].replicas == 2
    assert by_name["interactive"].kv_blocks == 2000
    long = by_name["extended"].pools[0]
    assert long.replicas == 3 and "nvfp4" in long.precision and "fp8 KV cache" in long.precision  # past 512K
    assert "EAGLE3" in long.speculative and "b200" in long.kernel_path
    assert "| interactive | 0 | 32K | 2 replicas, 2,000 KV blocks |" in to_markdown(contract)


def test_a_failed_target_names_its_dominant_stage() -> None:
    cfg = config(interactive={"targets": {"ttft_ms": {"p50": 100, "p95": 200}}})
    observed = observed_from_samples({"interactive": {"ttft": [0.05] * 90 + [0.5] * 10}},
                                     {"interactive": {"gateway queue": 0.3, "engine queue + prefill": 0.1,
                                                      "decode": 5.0}})
    contract = check(build_contract(cfg), observed, "test")
    verdicts = {v.percentile: v for v in contract.verdicts}
    assert verdicts["p50"].status == "PASS" and verdicts["p95"].status == "FAIL"
    assert verdicts["p95"].dominant_stage == "gateway queue"  # decode does not count against TTFT
    assert not passed(contract)
    assert "FAIL" in to_html(contract) and to_html(contract).count("<svg") == 2


def test_slo_rules_use_exact_bounds_and_leave_out_windows_that_cannot_fire() -> None:
    assert sli_bound(1.0, BOUNDS["ttft"]) == 1.0
    assert sli_bound(0.7, BOUNDS["ttft"]) == 0.5  # not a bound: the stricter one below
    rules = slo_rules(config(interactive={"targets": {"ttft_ms": {"p50": 250, "p99": 1000}}}), BOUNDS)
    recording, alerts = rules["groups"][0]["rules"], rules["groups"][1]["rules"]
    assert len(recording) == 2 * 7
    names = [a["alert"] for a in alerts]
    # P50: a 50% budget can burn at most 2x, so only the 1x (3d/6h) window pair is kept; P99 keeps all four.
    assert [n for n in names if "p50" in n] == ["M3gateSLOBurn_interactive_ttft_p50_3d"]
    assert len([n for n in names if "p99" in n]) == 4
    assert 'le="0.25"' in recording[0]["expr"]


def test_the_ring_keeps_requests_only_while_the_page_looks() -> None:
    ring = RecentRequests(size=3)
    ring.add(RequestRecord("chat", True, 10.0))
    assert not ring.ring
    ring.watched(100.0)
    for t in (101.0, 102.0, 103.0, 104.0):
        ring.add(RequestRecord("chat", True, t, t_routed=t + 0.001, t_admitted=t + 0.002, t_sent=t + 0.003,
                               t_first_byte=t + 0.1, t_last_byte=t + 0.5, status=200))
    ring.add(RequestRecord("chat", True, 200.0))  # after the window: not kept
    view = ring.view(now=105.0, wall_now=1000.0)
    assert len(view) == 3 and view[0]["at"] == pytest.approx(999.0)
    assert [s["stage"] for s in view[0]["stages"]] == ["gateway", "gateway queue", "dispatch",
                                                      "engine queue + prefill", "decode"]


def test_ui_state_needs_the_admin_key_and_shows_pools_classes_and_reload() -> None:
    app = build_app(config(admin={"api_key": "k" * 20}))
    client = TestClient(app)
    assert client.get("/ui").status_code == 200
    assert "content-security-policy" in client.get("/ui").headers
    assert client.get("/ui/static/ui.js").status_code == 200
    assert client.get("/ui/static/other.js").status_code == 404
    assert client.get("/ui/state").status_code == 401
    state = client.get("/ui/state", headers={"authorization": "Bearer " + "k" * 20}).json()
    assert [p["name"] for p in state["pools"]] == ["short", "long"]
    assert len(state["pools"][0]["replicas"]) == 2 and state["pools"][1]["launch_replicas"] == 3
    assert {c["name"] for c in state["classes"]} == {"interactive", "extended", "batch"}  # batch: the Batch API's
    assert state["reload"]["ok"] is True and state["sessions_api"] is True  # GET /admin/sessions exists
    assert state["latency"]["enabled"] is True and state["recent"] == []


def test_ui_can_be_turned_off() -> None:
    client = TestClient(build_app(config(admin={"ui": False})))
    assert client.get("/ui").status_code == 404 and client.get("/ui/state").status_code == 404


def test_ui_open_on_loopback_lets_loopback_in_without_the_key() -> None:
    app = build_app(config(admin={"api_key": "k" * 20, "ui_open_on_loopback": True}))
    assert TestClient(app, client=("127.0.0.1", 5000)).get("/ui/state").status_code == 200
    assert TestClient(app, client=("10.1.2.3", 5000)).get("/ui/state").status_code == 401
    closed = build_app(config(admin={"api_key": "k" * 20}))
    assert TestClient(closed, client=("127.0.0.1", 5000)).get("/ui/state").status_code == 401
    no_key = build_app(config())  # no admin key: loopback only, like /admin
    assert TestClient(no_key, client=("127.0.0.1", 5000)).get("/ui/state").status_code == 200
    assert TestClient(no_key, client=("10.1.2.3", 5000)).get("/ui/state").status_code == 403


def test_the_sessions_panel_is_fed_only_while_sessions_are_tracked() -> None:
    on = TestClient(build_app(config()), client=("127.0.0.1", 5000))
    assert on.get("/ui/state").json()["sessions_api"] is True
    assert set(on.get("/admin/sessions").json()) >= {"open", "recent", "open_sessions"}
    cfg = config().model_copy(update={"sessions": config().sessions.model_copy(update={"enabled": False})})
    off = TestClient(build_app(cfg), client=("127.0.0.1", 5000))
    assert off.get("/ui/state").json()["sessions_api"] is False
    assert off.get("/admin/sessions").status_code == 404


def test_ui_state_shows_a_precise_pools_exact_index() -> None:
    cfg = GatewayConfig.model_validate({
        "model": "m", "routing": {"policy": "prefix_affinity"},
        "pools": [{"name": "p", "max_model_len": 4096, "endpoints": ["http://127.0.0.1:9001"],
                   "precise": {"tokenizer": "replica"}}],
    })
    state = TestClient(build_app(cfg), client=("127.0.0.1", 5000)).get("/ui/state").json()
    assert state["pools"][0]["precise"] is True


def test_m3gate_contract_writes_files_and_rules_and_fails_on_an_unreachable_prometheus(tmp_path: object) -> None:
    from pathlib import Path

    import yaml

    from gateway.cli.commands import main

    tmp = Path(str(tmp_path))
    pools = tmp / "pools.yaml"
    pools.write_text(yaml.safe_dump({
        "model": "m", "pools": [{"name": "short", "max_model_len": 32768, "endpoints": ["http://127.0.0.1:9001"]}],
        "traffic": {"classes": {"interactive": {"targets": {"ttft_ms": {"p95": 500}, "tpot_ms": {"p99": 80}}}}},
    }))
    assert main(["contract", str(pools), "--out", str(tmp / "out"), "--rules", str(tmp / "slo.yml")]) == 0
    assert {p.name for p in (tmp / "out").iterdir()} == {"contract.md", "contract.html", "contract.json"}
    rules = yaml.safe_load((tmp / "slo.yml").read_text())
    assert {g["name"] for g in rules["groups"]} == {"m3gate-slo-recording", "m3gate-slo-alerts"}
    assert main(["contract", str(pools), "--prometheus", "http://127.0.0.1:1", "--window", "5m"]) == 2
