"""`m3gate plan`: a trace's demand per pool and class, sized by the capacity model; Markdown and JSON; the peak
window; prefix reuse as cached tokens; Mooncake traces; a disaggregated pool split into prefill and decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.commands import main
from gateway.capacity.plan import PlanError, read_trace

CONFIG = """
model: MiniMaxAI/MiniMax-M3
pools:
  - {name: interactive, max_model_len: 32768, kv_blocks: 4000, endpoints: ["http://127.0.0.1:9"],
     capacity: {min_replicas: 1, max_replicas: 64}}
  - name: repository
    max_model_len: 131072
    kv_blocks: 8000
    disaggregation: {prefill: {endpoints: ["http://127.0.0.1:11"]}, decode: {endpoints: ["http://127.0.0.1:12"]}}
traffic:
  classes:
    interactive: {targets: {ttft_ms: {p95: 1000}, tpot_ms: {p95: 60}}}
    repository: {priority: 1, targets: {ttft_ms: {p95: 10000}, tpot_ms: {p95: 100}}}
"""


def _trace(path: Path, rate: float, seconds: int, prompt: int = 6000, output: int = 300, long_every: int = 5) -> Path:
    rows = []
    n = int(rate * seconds)
    for i in range(n):
        long = long_every and i % long_every == 0
        rows.append({"timestamp": i / rate, "prompt_tokens": 60_000 if long else prompt, "output_tokens": output,
                     "prefix_group": f"g{i % 4}", "prefix_tokens": 2000})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _plan(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    config = tmp_path / "pools.yaml"
    config.write_text(CONFIG)
    assert main(["plan", str(config), "--workload", str(trace), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_sizes_every_pool_role_and_scales_with_the_demand(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    low = _plan(tmp_path, _trace(tmp_path / "low.jsonl", 10, 120), capsys)
    high = _plan(tmp_path, _trace(tmp_path / "high.jsonl", 20, 120), capsys)
    assert set(low["pools"]) == {"interactive", "repository"}
    assert set(low["pools"]["repository"]) == {"prefill", "decode"} and set(low["pools"]["interactive"]) == {"both"}
    a, b = low["pools"]["interactive"]["both"], high["pools"]["interactive"]["both"]
    assert a["demand"]["interactive"]["rate_mean_per_s"] == pytest.approx(8.0, rel=0.05)  # 4 in 5 are short
    assert a["predicted_peak"]["meets_targets"] and b["predicted_peak"]["meets_targets"]
    assert 1.5 <= b["replicas_peak"] / a["replicas_peak"] <= 2.5
    # the long prompts went to the larger pool, its class the pool's own; prefixes reused are cached
    long = low["pools"]["repository"]["prefill"]["demand"]["repository"]
    assert long["prompt_tokens"] == 60_000 and long["uncached_tokens"] == pytest.approx(58_000, rel=0.01)
    assert low["pools"]["repository"]["decode"]["predicted_peak"]["classes"]["repository"]["tpot_p95_s"] <= 0.1


def test_the_peak_window_sizes_a_burst_the_mean_hides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"timestamp": i * 2.0, "prompt_tokens": 6000, "output_tokens": 300} for i in range(300)]  # 0.5/s
    rows += [{"timestamp": 100 + i / 40, "prompt_tokens": 6000, "output_tokens": 300} for i in range(2400)]  # 40/s
    trace = tmp_path / "burst.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    r = _plan(tmp_path, trace, capsys, "--peak-window-s", "30")["pools"]["interactive"]["both"]
    assert r["replicas_peak"] > 2 * r["replicas_mean"]
    assert r["demand"]["interactive"]["rate_peak_per_s"] == pytest.approx(40.5, rel=0.05)


def test_markdown_names_each_role_and_the_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "pools.yaml"
    config.write_text(CONFIG)
    trace = _trace(tmp_path / "t.jsonl", 10, 60)
    assert main(["plan", str(config), "--workload", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Capacity plan")
    for row in ("| interactive | both |", "| repository | prefill |", "| repository | decode |"):
        assert row in out
    assert "| 1000 |" in out and "| 60 |" in out  # the interactive class's TTFT and TPOT p95 targets (ms)


def test_mooncake_traces_count_repeated_blocks_as_cached(tmp_path: Path) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in (
        {"timestamp": 0, "input_length": 2048, "output_length": 10, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 500, "input_length": 2048, "output_length": 10, "hash_ids": [1, 2, 9, 10]},
    )))
    first, second = read_trace(trace)
    assert (first.cached, second.cached) == (0, 1024) and second.at == pytest.approx(0.5)


def test_a_workload_yaml_is_planned_from_its_trace_and_bad_input_is_named(tmp_path: Path) -> None:
    sample = Path(__file__).parents[2] / "loadtests" / "lib" / "workloads" / "replay_simple_sample.yaml"
    assert len(read_trace(sample)) > 0
    generated = tmp_path / "classes.yaml"
    generated.write_text("name: x\nclasses: {}\n")
    with pytest.raises(PlanError, match="replay a trace"):
        read_trace(generated)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "prompt_tokens": 5}\nnot json\n')
    with pytest.raises(PlanError, match="line 2"):
        read_trace(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"timestamp": 0}\n')
    with pytest.raises(PlanError, match="request 1"):
        read_trace(missing)


class _Prometheus:
    """A Prometheus HTTP API on loopback answering the demand queries from fixed per-(pool, class) figures."""

    FIGURES = {("interactive", "interactive"): {"rate_mean": 8.0, "rate_peak": 16.0, "answered": 28_800.0,
                                                "prompt": 28_800 * 6000.0, "cached": 28_800 * 2000.0,
                                                "output": 28_800 * 300.0},
               ("none", "none"): {"rate_mean": 1.0, "rate_peak": 1.0, "answered": 0.0, "prompt": 0.0,
                                  "cached": 0.0, "output": 0.0}}

    def __enter__(self) -> str:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        figures = self.FIGURES
        self.queries: list[str] = []
        queries = self.queries

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                expr = parse_qs(urlsplit(self.path).query)["query"][0]
                queries.append(expr)
                key = ("rate_peak" if "max_over_time" in expr else "answered" if 'status="200"' in expr
                       else "prompt" if "m3gate_prompt_tokens" in expr else "cached" if "cached" in expr
                       else "output" if "output_tokens" in expr else "rate_mean")
                result = [{"metric": {"pool": pool, "class": cls}, "value": [0, str(v[key])]}
                          for (pool, cls), v in figures.items()]
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_plan_from_the_demand_prometheus_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "pools.yaml"
    config.write_text(CONFIG)
    prometheus = _Prometheus()
    with prometheus as url:
        assert main(["plan", str(config), "--prometheus", url, "--window", "8h", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["window"] == "8h" and all("[8h" in q or "[1m]" in q for q in prometheus.queries)
    entry = result["pools"]["interactive"]["both"]
    demand = entry["demand"]["interactive"]
    assert (demand["rate_mean_per_s"], demand["rate_peak_per_s"]) == (8.0, 16.0)
    assert (demand["prompt_tokens"], demand["uncached_tokens"], demand["output_tokens"]) == (6000, 4000, 300)
    assert entry["replicas_peak"] > entry["replicas_mean"] >= 1
    assert "none" not in result["pools"]  # requests refused before any pool: no pool to size


def test_plan_wants_one_source(tmp_path: Path) -> None:
    config = tmp_path / "pools.yaml"
    config.write_text(CONFIG)
    assert main(["plan", str(config)]) == 2
    assert main(["plan", str(config), "--prometheus", "http://127.0.0.1:9", "--window", "5m"]) == 2  # unreachable


def test_learnt_costs_from_a_saved_admin_capacity_answer_size_the_pools(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--costs FILE` (a saved GET /admin/capacity): a pool whose engine a gateway measured twice as slow as the
    defaults needs more replicas; a pool the file does not name keeps the given costs; a bad file is named."""
    trace = _trace(tmp_path / "t.jsonl", 10, 120)
    given = _plan(tmp_path, trace, capsys)
    slow = {"prefill_step_s": 0.04, "prefill_s_per_1k": 0.12, "decode_step_s": 0.04, "decode_s_per_seq": 4e-4,
            "decode_s_per_seq_1k": 4e-5, "kv_tokens": None}
    view = {"pools": {"interactive": {"both": {"current": 1, "desired": 2, "costs": slow}}}}
    costs = tmp_path / "capacity.json"
    costs.write_text(json.dumps(view))
    learnt = _plan(tmp_path, trace, capsys, "--costs", str(costs))
    a, b = given["pools"]["interactive"]["both"], learnt["pools"]["interactive"]["both"]
    assert (a["costs_source"], b["costs_source"]) == ("given", "learnt")
    assert b["replicas_peak"] > a["replicas_peak"]
    assert learnt["pools"]["repository"]["prefill"]["costs_source"] == "given"
    assert learnt["pools"]["repository"]["prefill"]["replicas_peak"] == given["pools"]["repository"]["prefill"]["replicas_peak"]
    costs.write_text(json.dumps({"interval_s": 5}))
    config = tmp_path / "pools.yaml"
    assert main(["plan", str(config), "--workload", str(trace), "--costs", str(costs)]) == 1
    assert "GET /admin/capacity" in capsys.readouterr().err
