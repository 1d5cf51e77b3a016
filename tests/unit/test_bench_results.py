"""loadtests/lib/results.py, the one results format of the benchmarks, and `make bench`'s table read from it."""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

import pytest

from loadtests.bench import __main__ as bench_main
from loadtests.bench import overhead, prefix_load
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


BENCH_DIR = Path(bench_main.__file__).parent


def _flags_and_imports(path: Path) -> tuple[set[str], set[str]]:
    """The `--flags` a module's source passes to add_argument, and the modules it imports from (anywhere in it)."""
    tree = ast.parse(path.read_text())
    flags = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
             and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
             and isinstance(n.args[0], ast.Constant) and str(n.args[0].value).startswith("--")}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return flags, modules


@pytest.mark.parametrize("name", [name for name, _ in benches()])
def test_every_benchmark_writes_results_json_through_the_shared_helper_and_has_quick_and_out(name: str) -> None:
    flags, modules = _flags_and_imports(BENCH_DIR / f"{name}.py")
    assert "loadtests.lib.results" in modules, f"{name} does not build its results with loadtests.lib.results"
    assert {"--quick", "--out"} <= flags, f"{name} lacks {sorted({'--quick', '--out'} - flags)}"


def test_the_list_names_every_module_with_its_whole_first_paragraph() -> None:
    listed = dict(benches())
    on_disk = {p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert set(listed) == on_disk
    assert {"prefix_load", "predictions_vllm", "sim_fidelity", "output_estimate", "batch", "scale",
            "opcodes"} <= set(listed)
    assert "\n" not in listed["precise"] and listed["precise"].endswith(".")  # its first paragraph wraps


def _plan_limits(argv: list[str], load: float, cores: int) -> dict[str, int]:
    args = argparse.Namespace(quick="--quick" in argv, skip=[], limit_factor=None)
    if "--limit-factor" in argv:
        args.limit_factor = float(argv[argv.index("--limit-factor") + 1])
    else:
        args.limit_factor = bench_main.limit_factor(load, cores)
    return {name: limit for name, _cmd, limit in bench_main._plan(args, Path("/tmp/x"))}


def test_part_limits_grow_with_the_machines_load_or_the_flag() -> None:
    idle = _plan_limits(["--quick"], load=0.5, cores=2)
    assert idle["overhead"] == bench_main.LIMITS["overhead"][0] and set(idle) == set(bench_main.LIMITS)
    loaded = _plan_limits(["--quick"], load=8.0, cores=2)
    assert all(loaded[name] == 4 * idle[name] for name in idle)
    assert _plan_limits(["--quick", "--limit-factor", "2.5"], load=8.0, cores=2)["overhead"] == \
        round(2.5 * bench_main.LIMITS["overhead"][0])
    assert _plan_limits([], load=0.0, cores=2)["policies"] == bench_main.LIMITS["policies"][1]


def test_skip_others_drops_the_hot_path_parts() -> None:
    args = argparse.Namespace(quick=True, skip=["others", "harness"], limit_factor=1.0)
    assert [name for name, *_ in bench_main._plan(args, Path("/tmp/x"))] == ["overhead", "policies"]


def _prefix_row(hit: float, p50: float, p90: float, req_s: float, oracle: float = 0.8) -> dict[str, object]:
    return {"hit_rate": hit, "of_oracle": hit / oracle, "ttft_p50": p50, "ttft_p90": p90, "req_s": req_s}


def test_prefix_load_turns_its_checks_into_figures_with_goals(tmp_path: Path) -> None:
    uniform = {"5": {"m3gate": _prefix_row(0.79, 300.0, 900.0, 4.9), "sglang": _prefix_row(0.6, 350.0, 800.0, 5.0)}}
    hot = {"10": {"m3gate": _prefix_row(0.5, 400.0, 700.0, 9.0), "sglang": _prefix_row(0.5, 500.0, 900.0, 9.0),
                  "never_move": _prefix_row(0.6, 450.0, 1000.0, 8.0)}}
    result = {"variants": {
        "uniform": {"rows": uniform, "oracle": {"5": 0.8}, "checks": prefix_load.checks("uniform", uniform)},
        "hot": {"rows": hot, "oracle": {"10": 0.8}, "checks": prefix_load.checks("hot", hot)}}}
    args = argparse.Namespace(quick=True, rounds=1, out=tmp_path)
    data = read(prefix_load.results_of(result, args).write(tmp_path))
    figures = {f["name"]: f for f in data["figures"]}
    hit = figures["[uniform] 5/s: m3gate hit rate ≥ 0.97 × oracle"]
    assert (hit["value"], hit["passed"]) == (pytest.approx(0.9875), True)
    p90 = figures["[uniform] 5/s: m3gate ttft_p90 ≤ SGLang's"]
    assert (p90["value"], p90["reference_value"], p90["unit"], p90["passed"]) == (900.0, 800.0, "ms", False)
    assert figures["[uniform] 5/s: m3gate completed req/s ≥ SGLang's"]["passed"] is False
    assert figures["[hot] 10/s: m3gate TTFT p90 ≤ 0.8 × never_move's"]["passed"] is True  # 700 ≤ 800
    assert figures["[hot] 10/s: never_move prefix-cache hit rate"]["passed"] is None
    assert figures["[hot] 10/s: never_move prefix-cache hit rate"]["value"] == pytest.approx(60.0)
    assert data["passed"] is False and data["name"] == "prefix_load"
    printed = {c["name"]: c["value"] for c in result["variants"]["uniform"]["checks"]}  # the summary's lines
    assert printed["5/s: m3gate ttft_p90 ≤ SGLang's"] == "900 vs 800 ms"
    assert printed["5/s: m3gate hit rate ≥ 0.97 × oracle"] == "0.988"


def _figures(results: Results, folder: Path) -> dict[str, dict[str, object]]:
    """The figures as read back from the written results.json."""
    return {f["name"]: f for f in read(results.write(folder))["figures"]}


def test_predictions_vllm_writes_each_levels_figures_without_a_goal(tmp_path: Path) -> None:
    from loadtests.bench import predictions_vllm

    quality = {"all": {"mape": 0.25, "p90_coverage": 0.85, "ratio_p50": 1.1}, "warm": {"mape": 0.2}}
    result = {"levels": [{"level": 0.7, "rate": 2.1, "ttft_p50": 120.0, "ttft_p95": 480.0, "prediction": quality},
                         {"level": 0.95, "rate": 2.85, "ttft_p50": None, "ttft_p95": None,
                          "prediction": {"all": {"n": 0}, "warm": {"n": 0}}}]}
    args = argparse.Namespace(quick=True, levels=[0.7, 0.95], out=None)
    figures = _figures(predictions_vllm.results_of(result, args), tmp_path)
    assert figures["TTFT MAPE, load 70% (2.10 req/s)"]["value"] == pytest.approx(25.0)
    assert figures["TTFT MAPE after the first 100 decisions, load 70% (2.10 req/s)"]["value"] == pytest.approx(20.0)
    coverage = figures["P90 coverage, load 70% (2.10 req/s)"]
    assert (coverage["value"], coverage["reference_value"]) == (pytest.approx(85.0), 90)
    assert figures["TTFT p95, load 70% (2.10 req/s)"]["value"] == 480.0
    assert figures["TTFT MAPE, load 95% (2.85 req/s)"]["value"] is None  # a level without decisions
    assert all(f["passed"] is None for f in figures.values())


def test_sim_fidelity_judges_the_relative_difference_against_five_per_cent(tmp_path: Path) -> None:
    from loadtests.bench.sim_fidelity import ReplayResult, report, results_of

    real = ReplayResult("vllm", hits=800.0, queries=1000.0, cached_tokens=[0, 512, 1024], prompt_tokens=[600] * 3)
    args = argparse.Namespace(quick=True, out=None)
    close = ReplayResult("sim", hits=780.0, queries=1000.0, cached_tokens=[0, 512, 896], prompt_tokens=[600] * 3)
    figures = _figures(results_of(report(real, close), args), tmp_path / "close")
    difference = figures["relative difference of the hit rates"]
    assert (difference["value"], difference["goal"], difference["passed"]) == (pytest.approx(2.5), "≤ 5%", True)
    assert figures["simulator prefix-cache hit rate"]["reference_value"] == pytest.approx(80.0)
    assert figures["requests with a different cached_tokens"]["value"] == 1
    far = ReplayResult("sim", hits=700.0, queries=1000.0, cached_tokens=[0, 512, 1024], prompt_tokens=[600] * 3)
    assert results_of(report(real, far), args).passed is False  # 12.5% apart


def test_batch_goals_become_figures(tmp_path: Path) -> None:
    from loadtests.bench import batch

    def run(high: float, low: float, done: float | None, hit: float | None = None) -> dict[str, object]:
        return {"phases": {"high": {"attainment": high}, "low": {"attainment": low}}, "batch_done_s": done,
                "batch_hit_rate": hit, "oracle": 0.8 if hit is not None else None}

    rows = {"none": run(0.95, 0.99, None), "loop": run(0.9, 0.97, 100.0, 0.5), "api": run(0.945, 0.97, 110.0, 0.76)}
    results = batch.results_of(rows, argparse.Namespace(quick=True, out=None))
    figures = _figures(results, tmp_path)
    assert figures["high-load SLO attainment beside the Batch API"]["passed"] is True  # within a point
    assert figures["low-load SLO attainment beside the Batch API"]["passed"] is False  # two points below
    assert figures["batch time / the client loop's"]["value"] == pytest.approx(1.1)
    assert figures["batch hit rate / the oracle's"]["value"] == pytest.approx(0.95)
    assert [line.split(":")[0] for line in batch.checks(results)] == ["PASS", "FAIL", "PASS", "PASS"]


def test_output_estimate_judges_the_estimate_against_the_budget(tmp_path: Path) -> None:
    from loadtests.bench import output_estimate as oe
    from policies.config import OutputEstimateConfig
    from policies.output_estimate import OutputEstimator

    cfg = OutputEstimateConfig()
    turns = oe.trace(20, seed=3)
    est = OutputEstimator((cfg.short_tokens, cfg.medium_tokens, cfg.long_tokens))
    rows = {name: oe.score(p, [t.actual for t in turns], est) for name, p in oe.replay(turns, cfg).items()}
    figures = _figures(oe.results_of(rows, argparse.Namespace(quick=True, out=None)), tmp_path)
    error = figures["estimate: median absolute error"]
    assert (error["value"], error["reference_value"]) == (rows["estimate"]["mae"], rows["max_tokens"]["mae"])
    assert error["passed"] == (rows["estimate"]["mae"] < rows["max_tokens"]["mae"])
    assert figures["max_tokens: Σ predicted ÷ Σ actual"]["value"] == rows["max_tokens"]["overcount"]
    assert figures["max_tokens: bucket accuracy"]["passed"] is None


def test_scale_and_opcodes_put_m3gate_beside_the_reference(tmp_path: Path) -> None:
    from loadtests.bench import opcodes, scale

    sizes = {16: {"nonstream": {"m3gate": 0.6, "sglang-router:cache_aware": 0.15}, "stream": {"m3gate": 0.9},
                  "idle": {"m3gate": 0.006}}}
    args = argparse.Namespace(quick=True, long_pool=100, out=None)
    figures = _figures(scale.results_of(sizes, {28000: {"m3gate": 3.0}}, "sglang-router:cache_aware", args),
                       tmp_path / "scale")
    assert figures["CPU per request, nonstream, N=16"]["reference_value"] == 0.15
    assert figures["CPU per request, stream, N=16"]["reference_value"] is None
    assert figures["idle CPU, N=16"]["value"] == pytest.approx(0.6)
    assert figures["CPU per request, 28,000-token prompt, N=100"]["value"] == 3.0
    a, b = Path("/w/main"), Path("/w/other")
    counts = {a: {f"{opcodes.REQUEST_TASK}|x.py:f": 900.0, "Periodic.run|y.py:g": 50.0},
              b: {f"{opcodes.REQUEST_TASK}|x.py:f": 1000.0}}
    ops = _figures(opcodes.results_of(counts, [a, b], argparse.Namespace(mode="stream", quick=True, out=None)),
                   tmp_path / "opcodes")
    assert ops["stream: main"]["value"] == 900.0 and ops["stream: main"]["reference"] is None
    assert (ops["stream: other"]["value"], ops["stream: other"]["reference_value"]) == (1000.0, 900.0)


def test_workers_bench_judges_the_ratio_and_the_hit_rate(tmp_path: Path) -> None:
    from loadtests.bench import workers

    def row(rps: float, cpu: float) -> dict[str, float]:
        return {"rps": rps, "gw_cpu_ms": cpu, "load_cpu_ms": 0.15, "fleet_cpu_ms": 0.03}

    tp = {workers.ONE: row(2000.0, 0.40), workers.SHARED: row(1900.0, 0.45), workers.TWO: row(3000.0, 0.50)}
    args = argparse.Namespace(quick=True, out=tmp_path)
    figures = _figures(workers.results_of(tp, {1: 0.80, 2: 0.78}, args), tmp_path)
    ratio = figures["req/s, 2 workers ÷ 1 process (load generator on the same cores)"]
    assert (ratio["value"], ratio["passed"]) == (pytest.approx(1.5), False)
    assert figures["2 cores' ceiling ÷ 1 core's, from the gateway's CPU per request"]["value"] == pytest.approx(1.6)
    assert figures["prefix-cache hit rate, 2 workers alternating"]["passed"] is True
    assert "| 2 workers | 3,000 | 1.50 | 0.500 |" in workers.report(tp, {1: 0.80, 2: 0.78}, 32)
