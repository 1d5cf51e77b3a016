"""How good the gateway's TTFT predictions are in front of REAL vLLM CPU servers (the tiny local model).

    python -m loadtests.bench.predictions_vllm [--quick] [--levels 0.3 0.7 0.95] [--duration 40] [--capacity REQ_S]
                                               [--out DIR]

The simulator is m3gate's own model of vLLM; this measures the calibrated model (policies/latency_model.py) where it
was not designed: two real vLLM CPU servers (`make vllm-env`; the tiny model from pools/vllm_local, 8K context, prefix
caching, block size 128) behind one pool of an instrumented gateway (loadtests.bench.slo's `--serve-instrumented`,
which logs every streamed decision's prediction beside the TTFT the gateway measured from the upstream send). The
trace is bench_slo's interactive mix scaled to an 8K context: bursty chats over six shared system prompts, and agent
sessions whose histories grow turn by turn. The rate is set to each `--levels` share of the pool's capacity, measured
first (the pool alone, overloaded: first tokens per second in steady state; `--capacity` skips it).

Printed per level: TTFT MAPE of the calibrated median (all, and after the pool's first 100 decisions), P90 coverage,
actual ÷ predicted median, the pool's learnt engine cost (seconds per step, per 1,000 tokens) and TTFT p50/p95. No
target: the issue asks for the figures. Results: loadtests/results/<time>-predictions-vllm/ (results.json,
summary.json, decision logs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.bench.slo import _pct, prediction_quality, read_jsonl
from loadtests.lib.client import Target
from loadtests.lib.harness import execute, run_dir
from loadtests.lib.replicas import MODEL, GatewayProc, wait_gateway_sees
from loadtests.lib.results import Results
from loadtests.lib.workload import Plan, build_plan
from loadtests.lib.workload_mix import agent_turns, interactive_mix, lognormal, uniform_int

MAX_MODEL_LEN = 8192
REPLICAS = 2


def spec(rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    """bench_slo's interactive mix in an 8K context: 60% bursty chats, 40% agent-session turns."""
    return interactive_mix(
        name="predictions-vllm", seed=seed, rate=rate, duration_s=duration_s, drain_s=60, turns_mean=4.0,
        chat={"prompt_tokens": lognormal(900, 0.5, 300, 2000), "output_tokens": uniform_int(8, 32),
              "shared_prefix": {"groups": 6, "tokens": 400, "distribution": "zipf"}},
        agent={
            **agent_turns(system_tokens=500, tools=4, tool_tokens=60, turns=(2, 5), first_user=(100, 400),
                          user=(30, 150), tool_result=lognormal(250, 0.5, 50, 600), output=(8, 32),
                          tool_call_output=(8, 16)),
            "pacing": "interval",
            "interval_s": {"dist": "exponential", "mean": 1.0, "min": 0.2, "max": 4},
        },
    )


def gateway_config(urls: list[str]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": MAX_MODEL_LEN, "endpoints": urls}],
        "routing": {"policy": "prefix_affinity"},
        "classification": {"output_budget": {"enabled": 64, "adaptive": 64, "disabled": 64}},
        "server": {"health_interval_s": 0.5},
        "admin": {"watch_config": False},
    }


def one_run(urls: list[str], plan: Plan, folder: Path, progress: bool | None) -> dict[str, Any]:
    logs = folder / "gateway"
    with GatewayProc(gateway_config(urls), serve_module=("loadtests.bench.slo", "--serve-instrumented",
                                                         str(logs))) as gw:
        wait_gateway_sees(gw.url, len(urls))
        time.sleep(0.6)
        report, run = execute(plan, Target(gateway=gw.url), replicas=urls, out_dir=folder, quiet=True,
                              progress=progress, plots=False, oracle=False)
        time.sleep(1.2)  # the probe flushes the decision log every second
    decisions = read_jsonl(logs / "decisions.jsonl")
    ttft = [1000 * r.ttft for r in run.results if r.ok and r.ttft is not None]
    cost = next((d["raw"].get("cost") for d in reversed(decisions) if d.get("raw")), None)
    return {"sent": report["sent"], "completed": report["overall"]["completed"],
            "failed": report["overall"]["failed"], "ttft_p50": _pct(ttft, 0.5), "ttft_p95": _pct(ttft, 0.95),
            "prediction": prediction_quality(decisions), "cost": cost}


def measure_capacity(urls: list[str], guess: float, duration_s: float, folder: Path, progress: bool | None) -> float:
    """First tokens per second the pool serves overloaded at 2× the guess (from a quarter of the run to its end)."""
    plan = build_plan(spec(2.0 * guess, duration_s, seed=99), source="bench_predictions_vllm")
    with GatewayProc(gateway_config(urls)) as gw:
        wait_gateway_sees(gw.url, len(urls))
        time.sleep(0.6)
        _, run = execute(plan, Target(gateway=gw.url), replicas=urls, out_dir=folder, quiet=True,
                         progress=progress, plots=False, oracle=False, drain_s=0.0)
    lo, hi = duration_s / 4, duration_s
    served = [r for r in run.results if r.ttft is not None and lo <= r.t_send + r.ttft <= hi]
    return len(served) / (hi - lo)


def _f(value: Any, spec_: str) -> str:
    return "–" if value is None else format(value, spec_)


def summary_text(result: dict[str, Any]) -> str:
    lines = [f"# TTFT predictions on real vLLM CPU servers ({REPLICAS} × tiny model, {MAX_MODEL_LEN} context)", "",
             f"Pool capacity {result['capacity']:.2f} req/s ({result['capacity_source']}); "
             f"{result['duration_s']:g} s of arrivals per level.", "",
             "| load | ok / sent | TTFT p50 / p95 ms | MAPE all / warmed up | P90 coverage all / warmed up | "
             "actual ÷ predicted p50 | learnt engine cost |", "|---|---|---|---|---|---|---|"]
    for row in result["levels"]:
        p = row["prediction"]
        a, w = p["all"], p["warm"]
        cost = row.get("cost") or {}
        lines.append(
            f"| {row['level']:.0%} ({row['rate']:.2f} req/s) | {row['completed']} / {row['sent']} | "
            f"{_f(row['ttft_p50'], '.0f')} / {_f(row['ttft_p95'], '.0f')} | {_f(a.get('mape'), '.1%')} / "
            f"{_f(w.get('mape'), '.1%')} | {_f(a.get('p90_coverage'), '.3f')} / {_f(w.get('p90_coverage'), '.3f')} | "
            f"{_f(a.get('ratio_p50'), '.2f')} | {_f(cost.get('step_s'), '.4f')} s + "
            f"{_f(cost.get('s_per_1k_tokens'), '.4f')} s/1K tokens |")
    lines += ["", f"command: `{result['command']}`", ""]
    return "\n".join(lines)


def _share(value: float | None) -> float | None:
    return None if value is None else 100 * value


def results_of(result: dict[str, Any], args: argparse.Namespace) -> Results:
    """Per load level: MAPE (all, warmed up), P90 coverage, actual ÷ predicted median, TTFT p50 / p95. No target (the
    issue asks for the figures): informational, in the one results format."""
    results = Results("predictions_vllm", vars(args), reference="the TTFT the gateway measured from the upstream send")
    for row in result["levels"]:
        at = f"load {row['level']:.0%} ({row['rate']:.2f} req/s)"
        a, w = row["prediction"]["all"], row["prediction"]["warm"]
        results.add(f"TTFT MAPE, {at}", _share(a.get("mape")), "%")
        results.add(f"TTFT MAPE after the first 100 decisions, {at}", _share(w.get("mape")), "%")
        results.add(f"P90 coverage, {at}", _share(a.get("p90_coverage")), "%", reference="nominal", reference_value=90)
        results.add(f"actual ÷ predicted TTFT median, {at}", a.get("ratio_p50"), "×")
        results.add(f"TTFT p50, {at}", row["ttft_p50"], "ms")
        results.add(f"TTFT p95, {at}", row["ttft_p95"], "ms")
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pools.vllm_local.launcher import running_servers

    folder = Path(args.out) if args.out else run_dir("predictions-vllm")
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with running_servers([MAX_MODEL_LEN] * REPLICAS) as servers:
        urls = [s.url for s in servers]
        print(f"{REPLICAS} vLLM servers up ({time.monotonic() - started:.0f} s)", flush=True)
        if args.capacity:
            capacity, source = args.capacity, "given"
        else:
            capacity = measure_capacity(urls, args.capacity_guess, args.capacity_s, folder / "capacity", args.progress)
            source = f"measured: the pool overloaded at 2× {args.capacity_guess:g} req/s for {args.capacity_s:g} s"
            print(f"pool capacity {capacity:.2f} req/s", flush=True)
        levels = []
        for level in args.levels:
            plan = build_plan(spec(level * capacity, args.duration, args.seed), source="bench_predictions_vllm")
            t = time.monotonic()
            row = {"level": level, "rate": level * capacity,
                   **one_run(urls, plan, folder / f"load{level:g}", args.progress)}
            levels.append(row)
            p = row["prediction"]["all"]
            print(f"  load {level:.0%}: MAPE {_f(p.get('mape'), '.1%')} coverage {_f(p.get('p90_coverage'), '.3f')}"
                  f" ({row['completed']}/{row['sent']} ok, {time.monotonic() - t:.0f} s)", flush=True)
    result = {"capacity": capacity, "capacity_source": source, "duration_s": args.duration, "levels": levels,
              "folder": str(folder), "command": "python -m loadtests.bench.predictions_vllm " + " ".join(sys.argv[1:])}
    (folder / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    text = summary_text(result)
    (folder / "summary.md").write_text(text)
    results_of(result, args).write(folder)
    print(text)
    print(f"results: {folder}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.predictions_vllm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=float, nargs="+", default=[0.3, 0.7, 0.95],
                        help="load as a share of the pool's capacity")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per level")
    parser.add_argument("--capacity", type=float, help="pool capacity, req/s (skip measuring it)")
    parser.add_argument("--capacity-guess", type=float, default=4.0, help="req/s; measured at twice this")
    parser.add_argument("--capacity-s", type=float, default=30.0, help="seconds of the capacity run")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", help="results folder")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--quick", action="store_true", help="one level (70%%), 20 s of arrivals, a 15 s capacity run")
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.duration, args.capacity_s = [0.7], 20.0, 15.0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
