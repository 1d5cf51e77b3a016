"""Agent programs on a saturated pool: session-fair ordering against arrival order at 25–250 concurrent sessions,
and the background lane beside foreground bursts.

    python -m loadtests.bench.agents [--quick] [--out DIR] [--levels 25,50,100,250] [--speed S]
                                     [--scenarios fairness background]

**fairness**: agent sessions (loadtests/lib/agent_programs.py: contexts growing from 20K–60K toward 200K tokens on
the repository pool, 5–40 turns, tool waits, short answers with a long tail, one session in 20 keeping 4 requests
in flight) replayed at each level of concurrent sessions (a slot takes the next planned session when its own ends;
1.25 × level sessions in all) through a gateway in front of 2 simulated replicas of 8 sequences each, whose class
admits 16 requests at once: the pool saturates and the gateway's queue decides the order. Each level runs twice on
the same sessions, `fairness: key` (arrival order) and `fairness: session` (least attained service first), each on
a fresh gateway with the replicas' caches reset, the order alternating between levels. Per run: TTFT p50/p99,
end-to-end p99, mean session time, output tokens per second while every slot was busy; per level: p99 TTFT and the
shortest quarter of sessions' (least planned work) mean time, key ÷ session. Goals at 250 sessions: p99 TTFT ≥ 2.8×,
short sessions ≥ 6.7× (the published figures), throughput ≥ 0.95 × key's.

**background** (loadtests/lib/background_lane.py): on 2 fresh replicas at real-time costs, foreground bursts (short
chats) first on the idle pool, then while a background class (`background: true`) saturates it with long greedy
streams (temperature 0, ignore_eos). Goals: foreground TTFT p95 ≤ 1.5 × the idle pool's; background output ≥ 80% of
the capacity the foreground leaves (the pool's rate with every sequence slot decoding, less the foreground's rate
during the bursts); every background answer whole and equal to its uninterrupted greedy answer (each prompt run
first straight to the replicas, where nothing can pause it, as tests/integration/test_background_lane_gateway.py
compares).

Scaled for a 2-core machine: a simulated prompt token stands for 20 real ones (its prefill costs 20 × 60 µs) and
every delay is divided by `--speed` (default 6): times are reported as measured. `--quick`: levels 25 and 100,
sessions of 3–10 turns, a shorter background phase (under 4 minutes). Results: loadtests/results/<time>-agents/
(results.json, agents.json, agents.md) or --out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.lib.agent_programs import (PREFILL_US_PER_TOKEN, TOKEN_SCALE, Population, SessionPlan, plan_sessions,
                                          run_population)
from loadtests.lib.background_lane import BackgroundRun, run_background
from loadtests.lib.harness import write_results
from loadtests.lib.replicas import SimPool, gateway, gateway_config, sim_pool, wait_gateway_sees
from loadtests.lib.results import Results

LEVELS = (25, 50, 100, 250)
MODES = ("key", "session")
REPLICAS = 2
SEQS_PER_REPLICA = 8
MAX_MODEL_LEN = 16_384  # simulated tokens: 327K real
GOAL_LEVEL = 250
GOAL_P99_TTFT = 2.8  # the published figures, key ÷ session at 250 sessions
GOAL_SHORT_SPEEDUP = 6.7
GOAL_THROUGHPUT = 0.95
SESSIONS_PER_SLOT = 1.25
# the background scenario's replicas: real-time costs (no token scaling), so a stream's tokens come at a rate the
# client and the gateway relay without running short of CPU
BACKGROUND_SIM_ARGS = ["--max-num-seqs", str(SEQS_PER_REPLICA), "--tool-call-probability", "0"]


def sim_args(speed: float) -> list[str]:
    """Replicas whose prefill costs what TOKEN_SCALE real tokens cost per simulated one (its chunk scaled alike)."""
    return ["--max-num-seqs", str(SEQS_PER_REPLICA), "--prefill-us-per-token", str(PREFILL_US_PER_TOKEN),
            "--max-num-batched-tokens", str(8192 // TOKEN_SCALE), "--speed", str(speed),
            "--tool-call-probability", "0", "--mean-output-tokens", "0"]


def fairness_config(urls: Sequence[str], mode: str) -> dict[str, Any]:
    """One repository class admitting as many requests as the replicas run at once: the rest wait in the gateway's
    queue, ordered by `mode`; replicas' queues do not count as saturation (the class limit is the gate)."""
    return gateway_config(urls, max_model_len=MAX_MODEL_LEN, extra={"traffic": {
        "pool_classes": {"bench": "repository"}, "latency_sensitive_disabled_thinking": False,
        "saturation": {"max_waiting": None, "max_kv_usage": None},
        "classes": {"repository": {"priority": 1, "max_concurrency": REPLICAS * SEQS_PER_REPLICA,
                                   "queue_length": 4096, "max_queue_wait_s": 900, "fairness": mode}}}})


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarise_run(pop: Population, short: set[int]) -> dict[str, Any]:
    """One run's figures: request latencies, session times (all, the shortest quarter), throughput while full."""
    results = [r for run in pop.runs for r in run.results]
    ok = [r for r in results if r.ok and r.ttft is not None]
    window = [r for r in ok if r.t_send + (r.e2el or 0.0) <= pop.full_until]
    times = [run.seconds for run in pop.runs if not run.failed and run.seconds is not None]
    short_times = [run.seconds for run in pop.runs
                   if run.plan.number in short and not run.failed and run.seconds is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[str(r.error)] = errors.get(str(r.error), 0) + 1
    return {
        "sessions": len(pop.runs), "failed_sessions": sum(1 for run in pop.runs if run.failed),
        "requests": len(results), "errors": errors,
        "ttft_p50_s": _pct([r.ttft for r in ok], 50), "ttft_p99_s": _pct([r.ttft for r in ok], 99),
        "e2e_p99_s": _pct([r.e2el for r in ok if r.e2el is not None], 99),
        # where the tail is: the heavy sessions' requests (several in flight) apart from the others'
        "ttft_p99_heavy_s": _pct([r.ttft for run in pop.runs if run.plan.heavy for r in run.results
                                  if r.ok and r.ttft is not None], 99),
        "ttft_p99_light_s": _pct([r.ttft for run in pop.runs if not run.plan.heavy for r in run.results
                                  if r.ok and r.ttft is not None], 99),
        "session_mean_s": _mean(times), "short_session_mean_s": _mean(short_times),
        "heavy_session_mean_s": _mean([run.seconds for run in pop.runs
                                       if run.plan.heavy and not run.failed and run.seconds is not None]),
        "output_tok_s": sum(r.output_tokens or 0 for r in window) / pop.full_until if pop.full_until else None,
        "full_s": pop.full_until, "elapsed_s": pop.elapsed,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def shortest_quarter(plans: Sequence[SessionPlan]) -> set[int]:
    ranked = sorted(plans, key=lambda p: (p.work_s, p.number))
    return {p.number for p in ranked[:max(1, len(ranked) // 4)]}


def run_level(pool: SimPool, level: int, plans: list[SessionPlan], order: Sequence[str], speed: float,
              ramp_s: float) -> dict[str, Any]:
    short = shortest_quarter(plans)
    row: dict[str, Any] = {"level": level, "order": list(order), "modes": {}}
    for mode in order:
        pool.reset()
        with gateway(fairness_config(pool.urls, mode)) as gw:
            wait_gateway_sees(gw.url, REPLICAS)
            load = os.getloadavg()[0]
            pop = asyncio.run(run_population(gw.url, plans, level, speed, ramp_s))
        row["modes"][mode] = {**summarise_run(pop, short), "load_avg_1m": [round(load, 1),
                                                                          round(os.getloadavg()[0], 1)]}
        m = row["modes"][mode]
        print(f"  {level} sessions, fairness {mode}: TTFT p50 {_s(m['ttft_p50_s'])} p99 {_s(m['ttft_p99_s'])}, "
              f"(heavy sessions' {_s(m['ttft_p99_heavy_s'])}, others' {_s(m['ttft_p99_light_s'])}), "
              f"e2e p99 {_s(m['e2e_p99_s'])}, session mean {_s(m['session_mean_s'])} (shortest quarter "
              f"{_s(m['short_session_mean_s'])}), {m['output_tok_s']:.0f} tok/s, {m['failed_sessions']} failed "
              f"sessions, {m['elapsed_s']:.0f} s", flush=True)
    key, ses = row["modes"]["key"], row["modes"]["session"]
    row["p99_ttft_ratio"] = _ratio(key["ttft_p99_s"], ses["ttft_p99_s"])
    row["short_speedup"] = _ratio(key["short_session_mean_s"], ses["short_session_mean_s"])
    row["throughput_ratio"] = _ratio(ses["output_tok_s"], key["output_tok_s"])
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


def fairness(pool: SimPool, levels: Sequence[int], speed: float, quick: bool, seed: int) -> list[dict[str, Any]]:
    rows = []
    for k, level in enumerate(levels):
        plans = plan_sessions(int(round(level * SESSIONS_PER_SLOT)), seed + level,
                              turns=(3, 10) if quick else (5, 40))
        order = MODES if k % 2 == 0 else tuple(reversed(MODES))
        print(f"fairness: {level} concurrent sessions ({len(plans)} in all, {sum(p.requests for p in plans)} "
              f"requests), {' then '.join(order)}", flush=True)
        rows.append(run_level(pool, level, plans, order, speed, ramp_s=min(10.0, 0.04 * level)))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Report


def markdown(rows: Sequence[dict[str, Any]], bg: BackgroundRun | None, speed: float) -> str:
    lines = []
    if rows:
        lines += [f"## Agent sessions: fairness key vs session (speed ×{speed:g}, times as measured)", "",
                  "| sessions | fairness | TTFT p50 | TTFT p99 | e2e p99 | session mean | shortest quarter mean | "
                  "heavy mean | output tok/s | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            for mode in MODES:
                m = r["modes"][mode]
                lines.append(f"| {r['level']} | {mode} | {_s(m['ttft_p50_s'])} | {_s(m['ttft_p99_s'])} | "
                             f"{_s(m['e2e_p99_s'])} | {_s(m['session_mean_s'])} | {_s(m['short_session_mean_s'])} | "
                             f"{_s(m['heavy_session_mean_s'])} | {m['output_tok_s']:.0f} | {m['failed_sessions']} |")
        lines += ["", "| sessions | p99 TTFT key ÷ session | shortest quarter key ÷ session | "
                  "throughput session ÷ key |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['level']} | {_x(r['p99_ttft_ratio'])} | {_x(r['short_speedup'])} | "
                         f"{_x(r['throughput_ratio'])} |")
    if bg is not None:
        lines += ["", "## Background lane beside foreground bursts", "", *bg.markdown()]
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def results_of(rows: Sequence[dict[str, Any]], bg: BackgroundRun | None, args: argparse.Namespace) -> Results:
    """Per level the six figures per mode and the three ratios (goals at GOAL_LEVEL); the background's three goals."""
    out = Results("agents", vars(args), reference="the same sessions with fairness: key (arrival order); the same "
                                                   "foreground bursts on the idle pool")
    for r in rows:
        level = r["level"]
        for mode in MODES:
            m = r["modes"][mode]
            for name, key, unit in (("TTFT p50", "ttft_p50_s", "s"), ("TTFT p99", "ttft_p99_s", "s"),
                                    ("e2e p99", "e2e_p99_s", "s"), ("mean session time", "session_mean_s", "s"),
                                    ("shortest quarter's mean time", "short_session_mean_s", "s"),
                                    ("output tokens/s while every slot was busy", "output_tok_s", "tok/s")):
                out.add(f"{level} sessions, fairness {mode}: {name}", m[key], unit)
        goal = level == GOAL_LEVEL  # the published figures are at 250 sessions; other levels are informational
        out.add(f"{level} sessions: p99 TTFT key ÷ session", r["p99_ttft_ratio"], "×", reference="fairness key",
                at_least=GOAL_P99_TTFT if goal else None)
        out.add(f"{level} sessions: shortest quarter's speed-up", r["short_speedup"], "×", reference="fairness key",
                at_least=GOAL_SHORT_SPEEDUP if goal else None)
        out.add(f"{level} sessions: throughput session ÷ key", r["throughput_ratio"], "×", reference="fairness key",
                at_least=GOAL_THROUGHPUT if goal else None)
    if bg is not None:
        bg.figures(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="levels 25 and 100, 3–10 turns, short background phase")
    parser.add_argument("--levels", default=None, help="concurrent sessions, comma-separated (default 25,50,100,250)")
    parser.add_argument("--speed", type=float, default=6.0, help="divide every modelled delay by this (default 6)")
    parser.add_argument("--scenarios", nargs="+", choices=("fairness", "background"),
                        default=["fairness", "background"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")] if args.levels else ([25, 100] if args.quick else list(LEVELS))
    args.levels = ",".join(map(str, levels))
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    bg: BackgroundRun | None = None
    with sim_pool(REPLICAS, MAX_MODEL_LEN, sim_args(args.speed)) as pool:
        if "fairness" in args.scenarios:
            rows = fairness(pool, levels, args.speed, args.quick, args.seed)
    if "background" in args.scenarios:
        with sim_pool(REPLICAS, MAX_MODEL_LEN, BACKGROUND_SIM_ARGS) as pool:
            bg = run_background(pool, REPLICAS * SEQS_PER_REPLICA, args.quick)
    md = markdown(rows, bg, args.speed)
    results = results_of(rows, bg, args)
    md += "\n\n" + "\n".join(f"- {'PASS' if f['passed'] else 'FAIL'}: {f['name']} {f['value']} (goal {f['goal']})"
                             for f in results.figures if f["passed"] is not None)
    md += f"\n\nRan {time.monotonic() - t0:.0f} s on {os.cpu_count()} CPUs."
    print(md)
    folder = write_results(args.out, "agents", {"args": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items()}, "fairness": rows,
                                                "background": bg.as_dict() if bg else None}, md)
    results.write(folder)
    print(f"results: {folder}")
    return 0 if results.passed is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
