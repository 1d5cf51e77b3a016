"""loadtests/bench_precise.py's pure parts: the split target, merged scrapes, per-scenario checks and verdict."""

from __future__ import annotations

from collections import Counter
from typing import Any

from loadtests.bench_precise import (
    MODES,
    SCENARIOS,
    SplitTarget,
    checks,
    main,
    merge_scrapes,
    summary_text,
    verdict,
)


def rows(hit: tuple[float, float], p95: tuple[float, float], failed: int = 0) -> dict[str, dict[str, Any]]:
    """round_robin, then approximate (hit[0], p95[0]) and precise (hit[1], p95[1])."""
    base = {"ttft_p50": 100.0, "ttft_p99": 900.0, "req_s": 9.0, "completed": 10, "failed": 0, "sent": 10,
            "preemptions": 0, "max_over_mean": 1.0, "gateway": {}}
    return {"round_robin": {**base, "mode": "round_robin", "hit_rate": 0.1, "ttft_p95": 2000.0},
            "prefix_affinity": {**base, "mode": "prefix_affinity", "hit_rate": hit[0], "ttft_p95": p95[0]},
            "precise": {**base, "mode": "precise", "hit_rate": hit[1], "ttft_p95": p95[1], "failed": failed}}


def result(**scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {name: {"scenario": SCENARIOS[name].__dict__, "rows": r, "checks": checks(r)} for name, r in
           scenarios.items()}
    return {"replicas": 4, "rounds": 1, "scenarios": out, "verdict": verdict(out)}


def test_split_target_spreads_requests_over_every_gateway_reproducibly() -> None:
    first, again = SplitTarget(["http://a/", "http://b"], seed=3), SplitTarget(["http://a", "http://b"], seed=3)
    picks = [first.pick() for _ in range(1000)]
    seen = Counter(picks)
    assert set(seen) == {"http://a", "http://b"} and 400 < seen["http://a"] < 600
    assert picks == [again.pick() for _ in range(1000)]
    one = SplitTarget(["http://a"])
    assert one.gateway == "http://a" and {one.pick() for _ in range(5)} == {"http://a"}


def test_merged_scrapes_sum_routing_counters_and_count_kv_events_once() -> None:
    a = {"reasons": {"affinity_hit": 3.0}, "events": {"stored": 10.0}}
    b = {"reasons": {"affinity_hit": 1.0, "cold_rendezvous": 2.0}, "events": {"stored": 10.0}}
    assert merge_scrapes([a, b]) == {"reasons": {"affinity_hit": 4.0, "cold_rendezvous": 2.0},
                                     "events": {"stored": 10.0}}


def test_checks_are_per_scenario_and_the_verdict_names_where_each_is_met() -> None:
    res = result(pressure=rows((0.40, 0.41), (1000.0, 900.0)), two_gateways=rows((0.40, 0.60), (1000.0, 700.0)))
    v = res["verdict"]
    target = "precise TTFT p95 ≤ 0.8 × approximate prefix_affinity's"
    assert v["checks"][target] == {"met": ["two_gateways"], "missed": ["pressure"]}
    assert v["ok"]
    text = summary_text(res, None)
    assert "FAIL  [pressure] precise TTFT p95" in text and "PASS  [two_gateways] precise TTFT p95" in text
    assert "met in two_gateways (ratio 0.70); missed in pressure (ratio 0.90)" in text
    assert all(f"| {mode} |" in text for mode in MODES)


def test_the_verdict_fails_when_a_check_is_met_nowhere_or_a_request_failed() -> None:
    assert not result(pressure=rows((0.4, 0.3), (1000.0, 700.0)))["verdict"]["ok"]  # hit rate lower
    assert not result(pressure=rows((0.4, 0.5), (1000.0, 900.0)))["verdict"]["ok"]  # p95 not 0.8x
    assert not result(pressure=rows((0.4, 0.5), (1000.0, 700.0)),
                      two_gateways=rows((0.4, 0.5), (1000.0, 700.0), failed=1))["verdict"]["ok"]


def test_the_cli_refuses_unknown_scenarios() -> None:
    try:
        main(["--scenarios", "nope", "--no-tokenize-cost"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown scenario was accepted")
