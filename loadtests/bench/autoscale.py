"""Autoscaling on a compressed day: m3gate's capacity signal against production-stack's KEDA rule, llm-d's
saturation rule and a pool fixed at the peak count, in one run.

`python -m loadtests.bench.autoscale [--quick]` starts, per policy, a gateway in front of simulated replicas
(loadtests/lib/autoscale.py: each new replica joins the pool file only after the start-up delay) and sends every policy
the same seeded day at the same time: night, a ramp ×4 up, the peak with a burst (interactive ×8 for half an hour)
and a long-context wave (repository prompts of 10–14K tokens), a ramp down and the evening, over the interactive and
repository classes. Per policy it prints SLO attainment per class (a request meets its class's targets in
traffic.classes.*.targets: TTFT ≤ the p95 target and TPOT ≤ the p95 target; errors miss), replica-seconds over the
day (a replica is billed from the ask, start-up included, to its removal), scale events, and the targets:

- m3gate against fixed: attainment within 2 points (each class) with at most 60% of its replica-seconds;
- m3gate against each threshold rule: +10 points (all requests) at no more replica-seconds, or the same attainment
  (at most 1 point lower) at no more than 80% of theirs;
- constant load (the night and afternoon phases): at most one change in any ten minutes.

Time: an hour of the day is `hour_s` seconds (15; 6 with --quick) and every control-loop time is multiplied by
`control` (0.05; 0.02 with --quick): start-up 180 s → 9 s, the signal's stabilization 300 s → 15 s, KEDA's cooldown
360 s → 18 s, the WVA's cycle 60 s → 3 s, ten minutes → 30 s. The day is thus compressed 240× and the control loops
20×: ramps are 12× steeper against start-up and windows than in a real day, a harder day for every autoscaler. The
signal's demand window is 20 s (10 s with --quick), not scaled: it is a measurement, sized by the requests it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtests.lib.autoscale import (
    BASE_RATE, BLOCK_SIZE, INTERACTIVE, REPOSITORY, CLASS_HEADER, CLASSES, DAY, KV_BLOCKS, POOL, TARGETS, Actuator, Day, Fixed, KedaWaiting,
    M3gateSignal, Policy, Saturation, Timescale, control_loop, gateway_config, monotonic,
)
from loadtests.lib.client import Result, Target, run_plan, tpot_of
from loadtests.lib.harness import write_results
from loadtests.lib.report import is_good
from loadtests.lib.results import Results
from loadtests.lib.workload import Plan, Slo
from policies.capacity import ClassDemand, EngineCosts, predict, size

POLICIES = ("m3gate", "keda", "llm-d", "fixed")
MAX_REPLICAS = 10
SPARES = 3  # processes kept started per autoscaled pool, so a new replica's start-up is `startup_s`, not the machine's
SIM_COSTS = EngineCosts(prefill_step_s=0.015, prefill_s_per_1k=0.3, decode_step_s=0.015, decode_s_per_seq=3e-4,
                        decode_s_per_seq_1k=0.0, kv_tokens=KV_BLOCKS * BLOCK_SIZE)


def slo(cls: str) -> Slo:
    t = TARGETS[cls]
    return Slo(ttft_ms=t["ttft_ms"]["p95"], tpot_ms=t["tpot_ms"]["p95"])


def planned(mult: float) -> int:
    """Replicas the model gives at the day's demand × `mult`, with the simulator's true costs (`m3gate plan`'s
    answer): the night's count starts the autoscaled pools, the peak's is the fixed pool."""
    demand = []
    for cls, shape in (("interactive", INTERACTIVE), ("repository", REPOSITORY)):
        prompt = sum(shape.prompt) / 2
        t = TARGETS[cls]
        demand.append(ClassDemand(cls, BASE_RATE[cls] * mult, prompt, prompt - shape.prefix_tokens, shape.output,
                                  t["ttft_ms"]["p95"] / 1000, t["tpot_ms"]["p95"] / 1000))
    return size("both", demand, SIM_COSTS).replicas


class Setup:
    """One policy's gateway and actuator."""

    def __init__(self, name: str, initial: int, scale: Timescale, spares: int = 0) -> None:
        self.name = name
        self.spares = spares
        self.initial = initial
        self.scale = scale
        self.actuator = Actuator(name, {}, None, scale.s(180.0), monotonic)
        self.gateway: Any = None
        self.results: dict[str, list[Result]] = {}

    async def start(self) -> None:
        from loadtests.lib.replicas import GatewayProc, wait_gateway_sees

        await self.actuator.start_now(self.initial, self.spares)
        config = gateway_config(self.actuator.urls(), self.scale, MAX_REPLICAS)
        self.gateway = await asyncio.to_thread(GatewayProc, config)
        self.actuator.config = config
        self.actuator.pool_file = self.gateway.config_path
        await asyncio.to_thread(wait_gateway_sees, self.gateway.url, self.initial, 30.0)

    def policy(self) -> Policy:
        a, s = self.actuator, self.scale
        if self.name == "m3gate":
            return M3gateSignal(a, self.gateway.url, s, 1, MAX_REPLICAS)
        if self.name == "keda":
            return KedaWaiting(a, s, 1, MAX_REPLICAS)
        if self.name == "llm-d":
            return Saturation(a, s, 1, MAX_REPLICAS)
        return Fixed(a, 3600.0, None, self.initial, self.initial)

    async def stop(self) -> None:
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
        await self.actuator.close()


async def run_day(setups: Sequence[Setup], day: Day, drain_s: float) -> tuple[float, dict[str, Policy]]:
    """Every policy's day at once; returns the start time (the actuators' clock) and the policies."""
    items = day.items()
    stop = asyncio.Event()
    policies = {s.name: s.policy() for s in setups}
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        loops = [asyncio.ensure_future(control_loop(p, http, stop)) for p in policies.values()]
        t0 = monotonic()
        sends = []
        for s in setups:
            for cls in CLASSES:
                plan = Plan(name=f"{s.name}-{cls}", items=items[cls], duration_s=day.duration_s, drain_s=drain_s,
                            timeout_s=180.0)
                sends.append((s, cls, run_plan(plan, Target(gateway=s.gateway.url), headers={CLASS_HEADER: cls},
                                               run_id=f"{s.name}-{cls}", progress=False)))
        outs = await asyncio.gather(*(coro for _, _, coro in sends))
        for (s, cls, _), out in zip(sends, outs):
            s.results[cls] = out.results
        stop.set()
        await asyncio.gather(*loops)
    return t0, policies


# ---------------------------------------------------------------------------------------------------------------
# Summaries


def _p95(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def class_summary(results: Sequence[Result], cls: str) -> dict[str, Any]:
    good = sum(1 for r in results if is_good(r, slo(cls)))
    ttfts = [r.ttft for r in results if r.ok and r.ttft is not None]
    tpots = [t for r in results if r.ok for t in [tpot_of(r)] if t is not None]
    return {"requests": len(results), "met": good, "attainment_pct": 100.0 * good / len(results) if results else None,
            "errors": sum(1 for r in results if not r.ok), "ttft_p95_s": _p95(ttfts), "tpot_p95_s": _p95(tpots)}


def constant_changes(events: Sequence[tuple[float, int, int]], day: Day, span_s: float) -> int:
    """The most scale events within any `span_s` inside a constant-load phase."""
    worst = 0
    for phase, start, end in day.bounds():
        if not phase.constant:
            continue
        times = [t for t, _, _ in events if start <= t < end]
        for i, t in enumerate(times):
            worst = max(worst, sum(1 for u in times[i:] if u < t + span_s))
    return worst


def policy_summary(setup: Setup, t0: float, day: Day) -> dict[str, Any]:
    a = setup.actuator
    events = [(e.at - t0, e.before, e.after) for e in a.events if e.at - t0 <= day.duration_s]
    every = [r for cls in CLASSES for r in setup.results.get(cls, [])]
    met = sum(1 for cls in CLASSES for r in setup.results.get(cls, []) if is_good(r, slo(cls)))
    return {
        "classes": {cls: class_summary(setup.results.get(cls, []), cls) for cls in CLASSES},
        "attainment_pct": 100.0 * met / len(every) if every else None,
        "replica_seconds": a.replica_seconds(t0, t0 + day.duration_s),
        "scale_events": len(events),
        "peak_replicas": max((n for _, n, _ in a.samples), default=setup.initial),
        "constant_load_changes": constant_changes(events, day, day.scale.s(600.0)),
        "events": [{"t": round(t, 1), "from": b, "to": n} for t, b, n in events],
        "timeline": [{"t": round(t - t0, 1), "ready": r, "asked": n} for t, r, n in a.samples[::2]],
        "failed_replicas": sum(1 for r in a.replicas if r.failed),
    }


def verdicts(s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets for m3gate against the others (None where a policy did not run)."""
    out: dict[str, Any] = {}
    m = s.get("m3gate")
    if m is None:
        return out
    if "fixed" in s:
        f = s["fixed"]
        within = all((m["classes"][c]["attainment_pct"] or 0) >= (f["classes"][c]["attainment_pct"] or 0) - 2.0
                     for c in CLASSES)
        share = m["replica_seconds"] / f["replica_seconds"]
        out["vs fixed"] = {"pass": within and share <= 0.60, "attainment_within_2": within,
                           "replica_seconds_share": round(share, 3)}
    for rule in ("keda", "llm-d"):
        if rule in s:
            r = s[rule]
            gain = (m["attainment_pct"] or 0) - (r["attainment_pct"] or 0)
            share = m["replica_seconds"] / r["replica_seconds"]
            ok = (gain >= 10.0 and share <= 1.0) or (gain >= -1.0 and share <= 0.80)
            out[f"vs {rule}"] = {"pass": ok, "attainment_gain": round(gain, 1),
                                 "replica_seconds_share": round(share, 3)}
    changes = m["constant_load_changes"]
    out["constant load"] = {"pass": changes <= 1, "max_changes_per_10_min": changes}
    return out


def model_check(policy: M3gateSignal, setup: Setup, t0: float, day: Day) -> list[dict[str, Any]]:
    """Per phase: the replicas the signal asked for and had, its predicted p95 TTFT/TPOT at the serving count
    (median over the phase), and the p95 measured on the requests sent in the phase."""
    rows = []
    for phase, start, end in day.bounds():
        entries = [e for t, e in policy.entries if start <= t - t0 < end]
        row: dict[str, Any] = {"phase": phase.name,
                               "desired": _median([e.get("desired") for e in entries]),
                               "serving": _median([e.get("current") for e in entries]),
                               "bottleneck": _mode([e.get("bottleneck") for e in entries])}
        at_serving = [_predict_at_serving(e) for e in entries]
        for cls in CLASSES:
            pred = [p.get(cls, {}) for p in at_serving]
            sent = [r for r in setup.results.get(cls, []) if start <= r.t_send < end]
            m = class_summary(sent, cls)
            row[cls] = {"attainment_pct": m["attainment_pct"],
                        "predicted_ttft_p95_s": _median([p.get("ttft_p95_s") for p in pred]),
                        "measured_ttft_p95_s": m["ttft_p95_s"],
                        "predicted_tpot_p95_s": _median([p.get("tpot_p95_s") for p in pred]),
                        "measured_tpot_p95_s": m["tpot_p95_s"], "requests": m["requests"]}
        rows.append(row)
    return rows


def _predict_at_serving(e: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """The model's p95s for the demand the gateway measured (not its lower bound, no lead) at the replicas serving,
    with the costs it had learnt: what to hold against the latencies measured meanwhile."""
    costs, demand = e.get("costs") or {}, e.get("demand") or {}
    if not costs or not demand or not e.get("current"):
        return {}
    engine = EngineCosts(costs["prefill_step_s"], costs["prefill_s_per_1k"], costs["decode_step_s"],
                         costs["decode_s_per_seq"], costs["decode_s_per_seq_1k"], costs.get("kv_tokens"))
    classes = [ClassDemand(name, d["rate_per_s"], d["prompt_tokens"], d["uncached_tokens"], d["output_tokens"],
                           d.get("ttft_p95_target_s"), d.get("tpot_p95_target_s"), d.get("queued") or 0.0)
               for name, d in demand.items()]
    p = predict("both", classes, engine, int(e["current"]), prefill_backlog=e.get("prefill_backlog_tokens") or 0.0)
    return {name: {"ttft_p95_s": c.ttft_p95_s if math.isfinite(c.ttft_p95_s) else None,
                   "tpot_p95_s": c.tpot_p95_s if math.isfinite(c.tpot_p95_s) else None}
            for name, c in p.classes.items()}


def _signal_row(t: float, e: dict[str, Any]) -> dict[str, Any]:
    """One /admin/capacity sample, compactly: the counts, why, and the demand and costs they rest on."""
    return {"t": round(t, 1), **{k: e.get(k) for k in ("current", "desired", "needed", "needed_now", "bottleneck",
                                                      "lead_factor", "prefill_backlog_tokens")},
            "rates": {c: d.get("rate_per_s") for c, d in (e.get("demand") or {}).items()},
            "queued": {c: d.get("queued") for c, d in (e.get("demand") or {}).items()},
            "risk_factor": e.get("risk_factor"),
            "measured_ttft_p95_s": {c: d.get("measured_ttft_p95_s") for c, d in (e.get("demand") or {}).items()},
            "measured_tpot_p95_s": {c: d.get("measured_tpot_p95_s") for c, d in (e.get("demand") or {}).items()},
            "costs": e.get("costs")}


def _median(values: Sequence[Any]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


def _mode(values: Sequence[Any]) -> str | None:
    got = [v for v in values if v is not None]
    return max(set(got), key=got.count) if got else None


# ---------------------------------------------------------------------------------------------------------------
# Output


def _f(v: Any, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown(summary: dict[str, Any]) -> str:
    s = summary["policies"]
    lines = [f"### Autoscaling on a compressed day ({summary['day_s']:.0f} s; {summary['timescale']})", "",
             "| policy | interactive met | repository met | all met | replica-seconds | scale events | peak | "
             "constant-load changes / 10 min |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in s.items():
        c = p["classes"]
        lines.append(f"| {name} | {_f(c['interactive']['attainment_pct'])}% | {_f(c['repository']['attainment_pct'])}% "
                     f"| {_f(p['attainment_pct'])}% | {p['replica_seconds']:.0f} | {p['scale_events']} | "
                     f"{p['peak_replicas']} | {p['constant_load_changes']} |")
    lines += ["", "| target | verdict | figures |", "|---|---|---|"]
    for name, v in summary["verdicts"].items():
        figures = ", ".join(f"{k} {val}" for k, val in v.items() if k != "pass")
        lines.append(f"| m3gate {name} | {'PASS' if v['pass'] else 'FAIL'} | {figures} |")
    if summary.get("model_check"):
        lines += ["", "m3gate's model at the counts it chose (median over the phase of its p95 at the measured demand "
                  "and the serving count, against the p95 measured on the phase's requests; seconds):", "",
                  "| phase | desired | serving | bottleneck | int. met | int. TTFT pred/meas | int. TPOT pred/meas | "
                  "repo met | repo TTFT pred/meas | repo TPOT pred/meas |", "|---|---:|---:|---|---:|---|---|---:|---|---|"]
        for row in summary["model_check"]:
            cells = []
            for cls in CLASSES:
                r = row[cls]
                cells.append(f"{_f(r.get('attainment_pct'))}%")
                cells.append(f"{_f(r['predicted_ttft_p95_s'], 2)} / {_f(r['measured_ttft_p95_s'], 2)}")
                cells.append(f"{_f(r['predicted_tpot_p95_s'], 3)} / {_f(r['measured_tpot_p95_s'], 3)}")
            lines.append(f"| {row['phase']} | {_f(row['desired'])} | {_f(row['serving'])} | {row['bottleneck']} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a shorter day (6 s an hour, control ×0.02; ~3 min)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--hour-s", type=float, default=None, help="seconds per hour of the day (default 15)")
    parser.add_argument("--control", type=float, default=None, help="control-loop time factor (default 0.05)")
    parser.add_argument("--fixed", type=int, default=None, help="the fixed pool's count (default: the autoscalers' "
                        "ceiling, 10, what the peak needs on a 2-core machine)")
    parser.add_argument("--initial", type=int, default=None, help="the autoscaled pools' first count (default: "
                        "planned night)")
    parser.add_argument("--drain-s", type=float, default=30.0, help="seconds answers may take after the day")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default loadtests/results/<run>)")
    args = parser.parse_args(argv)
    scale = Timescale(hour_s=args.hour_s or (6.0 if args.quick else 15.0),
                      control=args.control or (0.02 if args.quick else 0.05), window_s=10.0 if args.quick else 20.0)
    day = Day(DAY, scale, args.seed)
    night, peak = planned(1.0), planned(4.0)
    fixed = args.fixed or MAX_REPLICAS
    initial = args.initial or night
    spares = 1 if args.quick else SPARES
    setups = [Setup(name, fixed, scale) if name == "fixed" else Setup(name, initial, scale, spares)
              for name in args.policies]
    print(f"day {day.duration_s:.0f} s, {scale}; planned night {night}, peak {peak}; fixed pool {fixed}", flush=True)
    summary = asyncio.run(_run(setups, day, drain_s=args.drain_s))
    summary.update({"planned": {"night": night, "peak": peak, "fixed": fixed}, "sim_costs": asdict(SIM_COSTS)})
    md = markdown(summary)
    folder = write_results(args.out, "bench_autoscale", summary, md)
    results_of(summary, args).write(folder)
    print(md)
    print(f"results: {folder}")
    return 0


def results_of(summary: dict[str, Any], args: argparse.Namespace) -> Results:
    """Each policy's requests within targets and replica-seconds, and m3gate's verdicts against the others, in the
    one results format."""
    out = Results("autoscale", vars(args), reference="a fixed pool at the peak's count, KEDA's and llm-d's rules, "
                  "on the same day")
    for name, s in summary["policies"].items():
        out.add(f"{name}: requests within targets", s["attainment_pct"], "%")
        out.add(f"{name}: replica-seconds", s["replica_seconds"], "replica-s")
    v = summary["verdicts"]
    if "vs fixed" in v:
        out.add("m3gate replica-seconds / the fixed pool's", v["vs fixed"]["replica_seconds_share"], "×",
                goal="≤ 0.6×, within 2 points of its attainment", passed=v["vs fixed"]["pass"])
    for rule in ("keda", "llm-d"):
        if f"vs {rule}" in v:
            out.add(f"m3gate attainment gain over {rule}", v[f"vs {rule}"]["attainment_gain"], "points",
                    reference=f"replica-seconds × {rule}'s", reference_value=v[f"vs {rule}"]["replica_seconds_share"],
                    goal="≥ +10 at ≤ 1× the replica-seconds, or ≥ −1 at ≤ 0.8×", passed=v[f"vs {rule}"]["pass"])
    if "constant load" in v:
        out.add("m3gate scale changes per 10 min at constant load", v["constant load"]["max_changes_per_10_min"],
                "changes", at_most=1)
    return out


async def _run(setups: Sequence[Setup], day: Day, drain_s: float) -> dict[str, Any]:
    try:
        await asyncio.gather(*(s.start() for s in setups))
        t0, policies = await run_day(setups, day, drain_s)
    finally:
        await asyncio.gather(*(s.stop() for s in setups), return_exceptions=True)
    summaries = {s.name: policy_summary(s, t0, day) for s in setups}
    scale = day.scale
    timescale = f"hour {scale.hour_s:g} s, control ×{scale.control:g}, window {scale.window_s:g} s"
    out: dict[str, Any] = {"day_s": day.duration_s, "pool": POOL, "timescale": timescale,
                           "policies": summaries, "verdicts": verdicts(summaries),
                           "phases": [{"phase": p.name, "start_s": a, "end_s": b} for p, a, b in day.bounds()]}
    m3 = policies.get("m3gate")
    if isinstance(m3, M3gateSignal):
        setup = next(s for s in setups if s.name == "m3gate")
        out["model_check"] = model_check(m3, setup, t0, day)
        out["signal"] = [_signal_row(t - t0, e) for t, e in m3.entries[::2]]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
