"""loadtests/bench/precise.py's pure parts: the split target, merged scrapes, per-scenario checks and verdict."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from loadtests.bench.precise import (
    MODES,
    SCENARIOS,
    TARGET,
    TARGET_REST,
    SplitTarget,
    checks,
    first_of_group_split,
    main,
    merge_scrapes,
    split_folder,
    summary_text,
    verdict,
)


def rows(hit: tuple[float, float], p95: tuple[float, float], failed: int = 0,
         rest: tuple[float, float] | None = None) -> dict[str, dict[str, Any]]:
    """round_robin, then approximate (hit[0], p95[0]) and precise (hit[1], p95[1]); `rest`: their p95 excluding
    first-of-group requests (default: the same as p95)."""
    rest = rest or p95
    base = {"ttft_p50": 100.0, "ttft_p99": 900.0, "req_s": 9.0, "completed": 10, "failed": 0, "sent": 10,
            "preemptions": 0, "max_over_mean": 1.0, "gateway": {}, "first_of_group": 2, "cold_share": 0.4,
            "ttft_p50_first": 300.0, "ttft_p95_first": 400.0, "ttft_p50_rest": 90.0, "tail": 1, "tail_first": 0,
            "tail_cold": 1}
    return {"round_robin": {**base, "mode": "round_robin", "hit_rate": 0.1, "ttft_p95": 2000.0,
                            "ttft_p95_rest": 2000.0},
            "prefix_affinity": {**base, "mode": "prefix_affinity", "hit_rate": hit[0], "ttft_p95": p95[0],
                                "ttft_p95_rest": rest[0]},
            "precise": {**base, "mode": "precise", "hit_rate": hit[1], "ttft_p95": p95[1], "ttft_p95_rest": rest[1],
                        "failed": failed}}


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
    assert "p50 / p95 excl. first-of-group" in text and "| 90 / 1000 |" in text


def test_the_p95_target_is_checked_over_every_request_and_excluding_first_of_group() -> None:
    # all-requests ratio 0.9 (missed), excluding first-of-group 0.7 (met): both reported, neither replaces the other
    res = result(pressure=rows((0.4, 0.5), (1000.0, 900.0), rest=(1000.0, 700.0)))
    v = res["verdict"]
    assert v["checks"][TARGET] == {"met": [], "missed": ["pressure"]}
    assert v["checks"][TARGET_REST] == {"met": ["pressure"], "missed": []}
    assert not v["ok"]  # the all-requests target still decides
    text = summary_text(res, None)
    assert "FAIL  [pressure] precise TTFT p95 ≤" in text and "PASS  [pressure] precise TTFT p95 excl." in text
    assert "Target (precise TTFT p95 ≤ 0.8× approximate's): met in no scenario; missed in pressure (ratio 0.90)" in text
    assert "Same, excluding first-of-group requests: met in pressure (ratio 0.70)" in text
    # and the other way round: met over every request but not excluding first-of-group fails too
    assert not result(pressure=rows((0.4, 0.5), (1000.0, 700.0), rest=(1000.0, 900.0)))["verdict"]["ok"]


def req(index: int, t_send: float, group: str | None, ttft: float | None, cached: int | None = 0) -> SimpleNamespace:
    return SimpleNamespace(index=index, t_send=t_send, prefix_group=group, ttft=ttft, cached_tokens=cached)


def test_first_of_group_is_the_first_sent_of_each_prefix_group() -> None:
    results = [
        req(0, 0.2, "g1", 0.30),  # sent after index 1: not first of g1
        req(1, 0.1, "g1", 0.28),  # first of g1 (compulsory)
        req(2, 0.3, "g2", 0.29),  # first of g2
        req(3, 0.4, "g2", 0.05, cached=4096),
        req(4, 0.5, "g1", 2.00),  # a capacity miss queued: the tail, not first of its group
        req(5, 0.6, None, 0.10, cached=None),  # no group: counts with the rest
        req(6, 0.7, "g3", None),  # failed before a first token: left out (g3 has no first then)
        req(7, 0.8, "g3", 0.27),  # so this one is g3's first
    ]
    s = first_of_group_split(results)
    assert s["n"] == 7 and s["first_of_group"] == 3 and s["first_share"] == pytest.approx(3 / 7)
    assert s["cold_share"] == pytest.approx(5 / 7)
    assert s["ttft_p50_first"] == pytest.approx(280.0) and s["ttft_p50_rest"] == pytest.approx(200.0)
    assert s["tail"] == 1 and s["tail_first"] == 0 and s["tail_cold"] == 1
    empty = first_of_group_split([])
    assert empty["n"] == 0 and empty["ttft_p95_rest"] is None and empty["tail"] == 0


def test_split_folder_reads_an_earlier_runs_results(tmp_path: Any) -> None:
    import json

    run = tmp_path / "pressure-precise-r0"
    run.mkdir()
    lines = [{"index": i, "t_send": i * 0.1, "prefix_group": f"g{i % 2}", "ttft": 0.1 + i / 100,
              "cached_tokens": 0 if i < 2 else 256, "status": 200} for i in range(6)]
    (run / "results.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (out,) = split_folder(tmp_path)
    assert out.startswith("pressure-precise-r0") and "(2/6)" in out and "cold 33%" in out


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
