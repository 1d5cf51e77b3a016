"""loadtests/lib/results.py, the one results format of the benchmarks, and `make bench`'s table read from it."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from loadtests.bench import overhead
from loadtests.bench.__main__ import benches, summary
from loadtests.lib.results import FILE, SCHEMA, Results, read, table


def _overhead() -> Results:
    results = Results("overhead", {"quick": True, "out": Path("/tmp/x")}, reference="the replicas directly")
    results.add("added latency p50", 0.42, "ms", at_most=1.0, reference="direct", reference_value=1.2)
    results.add("requests per CPU-second", 1500.0, "req/CPU-s", at_least=2000)
    results.add("ITL added p99", 0.12, "ms")
    return results


def test_goals_decide_each_figure_and_the_run(tmp_path: Path) -> None:
    data = read(_overhead().write(tmp_path))
    assert data["schema"] == SCHEMA and data["name"] == "overhead"
    assert data["parameters"] == {"quick": True, "out": "/tmp/x"}  # a Path is written as its text
    verdicts = {f["name"]: (f["goal"], f["passed"]) for f in data["figures"]}
    assert verdicts == {"added latency p50": ("≤ 1 ms", True),
                        "requests per CPU-second": ("≥ 2,000 req/CPU-s", False),
                        "ITL added p99": (None, None)}
    assert data["passed"] is False


def test_a_missing_or_nan_value_fails_its_goal_and_informational_runs_have_no_verdict() -> None:
    results = Results("x", {})
    results.add("p50", math.nan, "ms", at_most=1.0)
    results.add("p99", None, "ms", at_least=0.0)
    assert [f["value"] for f in results.figures] == [None, None]
    assert results.passed is False
    informational = Results("y", {})
    informational.add("throughput", 12.0, "req/s")
    assert informational.passed is None


def test_read_refuses_another_format(tmp_path: Path) -> None:
    path = tmp_path / FILE
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="schema"):
        read(path)


def test_the_table_shows_value_reference_goal_and_verdict(tmp_path: Path) -> None:
    text = table([read(_overhead().write(tmp_path))])
    assert "| overhead | added latency p50 | 0.42 ms | direct 1.2 ms | ≤ 1 ms | PASS |" in text
    assert "| overhead | requests per CPU-second | 1,500 req/CPU-s |  | ≥ 2,000 req/CPU-s | FAIL |" in text


def test_a_pipe_in_a_cell_does_not_split_the_row() -> None:
    results = Results("x", {})
    results.add("a | b", 1.0, "ms", goal="|p50| ≤ 5 ms", passed=True)
    row = table([results.as_dict()]).splitlines()[-1]
    assert row == "| x | a \\| b | 1 ms |  | \\|p50\\| ≤ 5 ms | PASS |"


def test_make_bench_summary_reads_each_parts_results_and_names_those_without(tmp_path: Path) -> None:
    _overhead().write(tmp_path / "overhead")
    rows = [{"bench": "overhead", "status": "ran (targets missed)", "seconds": 12.0},
            {"bench": "policies", "status": "TIMEOUT", "seconds": 240.0}]
    text = summary(rows, tmp_path, 252.0)
    assert "| overhead | added latency p50 | 0.42 ms |" in text
    assert f"| policies | no {FILE} (TIMEOUT: FileNotFoundError) |" in text
    assert "overhead ran (targets missed) 12 s, policies TIMEOUT 240 s" in text


def test_every_benchmark_module_is_listed_with_a_description() -> None:
    listed = dict(benches())
    assert {"overhead", "policies", "classify", "routing", "ui"} <= set(listed)
    assert all(listed.values())


def test_the_overhead_bench_reads_its_targets_from_its_result() -> None:
    result = {
        "nonstream_c32": {"added_p50_ms": 0.8, "added_p99_ms": 3.5, "direct": {"p50_ms": 2.0, "p99_ms": 4.0},
                          "gateway": {"req_per_cpu_s": 2500.0}},
        "stream_paced_c64": {"gateway": {"events_per_cpu_s": 30000.0}, "added_itl_p99_ms": 0.1},
        "open_streams": {"opened": 4990, "gw_rss_peak_mib": 300.0},
        "reference": {"modes": {"pinned": {"nonstream_c32": {"m3gate": {"cpu_ms_per_req_median": 0.9},
                                                             "sglang-router": {"cpu_ms_per_req_median": 0.4}}}}},
    }
    args = argparse.Namespace(open_streams=5000, quick=True)
    figures = {f["name"]: f["passed"] for f in overhead.results_of(result, args).figures}
    assert figures == {
        "added latency p50 at c=32 (non-stream)": True, "added latency p99 at c=32 (non-stream)": False,
        "requests per gateway CPU-second (non-stream, c=32)": True,
        "relayed SSE events per gateway CPU-second (paced, c=64)": True, "ITL added p99 (paced, c=64)": None,
        "concurrent open streams": False, "gateway RSS peak with them open": True,
        "CPU per request (non-stream c=32, pinned)": False,
    }
