"""Routing policies side by side on one multi-turn agent workload, in one run.

    python -m loadtests.bench.policies [--quick] [--rounds N] [--speeds 1.0 0.7] [--workload YAML]

Four simulated replicas whose KV cache holds only part of the working set (512 blocks of 128 tokens each: an
affinity share of the sessions fits, all of them do not, so a cache-blind spread evicts what the next turn needs) and
whose prefill costs real time (60 µs per uncached prompt token, 12 ms per decode step, divided by --speed) serve the
same agent trace: sessions sharing three system prompts with their tool schemas, histories growing by tool-result
and user turns, think and tool times between turns. It goes

- through a gateway under each `routing.policy` (round_robin, least_loaded, prefix_affinity), restarted per policy;
- directly (the client round-robins the replicas).

The replicas' caches and counters are reset (`POST /sim/reset`) before every run. Printed side by side: the hit rate
from the replicas' own /metrics (Δ vllm:prefix_cache_hits_total / Δ queries_total), the oracle hit rate (a replica per
session with an infinite cache, computed from the trace's token structure; loadtests.lib.oracle), TTFT p50/p95/p99,
throughput, and the most loaded replica over the mean. Then PASS/FAIL for prefix_affinity:

- hit rate ≥ 0.95 × the oracle's;
- TTFT p95 ≤ 0.5 × round_robin's;
- no replica above 1.5 × the mean load (requests).

The whole comparison is repeated per load level (`--speeds`: the replicas' --speed; lower = slower replicas = a
heavier load for the same arrivals): the benefit of cache affinity on TTFT grows with load, as queues amplify the
extra prefill that misses cost. With --rounds > 1 the modes are interleaved round by round and the medians are
compared. Diagnostics follow (routing reasons from the gateway's /metrics, how often sessions changed replica and what
the slowest 10% of TTFTs were) to explain a miss. Results: loadtests/results/<time>-policies/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from loadtests.lib.client import RunOutput, Target
from loadtests.lib.harness import execute, run_dir
from loadtests.lib.oracle import oracle_hit_rates, token_structure
from loadtests.lib.replicas import GatewayProc, gateway_config, sim_pool, wait_gateway_sees
from loadtests.lib.report import routing_reasons
from loadtests.lib.results import Results
from loadtests.lib.workload import Plan, build_plan, load_workload
from loadtests.lib.workload_mix import agent_turns, lognormal

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")
MODES = (*POLICIES, "direct")
REPLICAS = 4
KV_BLOCKS = 512  # 65K tokens per replica: an affinity share of the sessions fits, all of them do not
SIM_ARGS = ["--max-num-seqs", "64", "--tool-call-probability", "0",
            "--prefill-us-per-token", "60", "--decode-ms-per-step", "12"]


def agent_spec(quick: bool, seed: int = 11) -> dict[str, Any]:
    """Agents: 3 system prompts (1,500 tokens) with 8 tool schemas each, histories growing by tool results."""
    return {
        "name": "policies-agent",
        "seed": seed,
        "duration_s": 25 if quick else 75,
        "drain_s": 30,
        "sessions": [{
            "name": "agent",
            "count": 40 if quick else 64,
            "arrival": {"process": "poisson", "rate": 4.0 if quick else 1.5},
            **agent_turns(system_tokens=1500, tools=8, tool_tokens=100, turns=(5, 8) if quick else (6, 12),
                          first_user=(500, 2000), user=(50, 300), tool_result=lognormal(1000, 0.5, 200, 3000),
                          output=(40, 120), tool_call_output=(20, 40)),
            "think_time_s": {"dist": "exponential", "mean": 0.5 if quick else 1.0, "max": 4},
            "tool_time_s": {"dist": "exponential", "mean": 0.2, "max": 1},
            "thinking_share": 0.5,
            "slo": {"ttft_ms": 1000, "tpot_ms": 100},
        }],
    }


def diagnostics(run: RunOutput, plan: Plan) -> dict[str, Any]:
    """How sessions and system-prompt groups spread over replicas (from the client's own results)."""
    by_session: dict[str, list[str]] = defaultdict(list)
    group_of: dict[str, str] = {}
    groups_on: dict[str, Counter[str]] = defaultdict(Counter)
    for r in sorted(run.results, key=lambda r: (r.session or "", r.turn)):
        if r.session and r.replica:
            by_session[r.session].append(r.replica)
            group_of[r.session] = r.prefix_group or "?"
            groups_on[r.replica][r.prefix_group or "?"] += 1
    switches = sum(sum(1 for a, b in zip(v, v[1:]) if a != b) for v in by_session.values())
    turns = sum(max(0, len(v) - 1) for v in by_session.values())
    distinct = [len(set(v)) for v in by_session.values()]
    first_replica: dict[str, Counter[str]] = defaultdict(Counter)
    for sid, reps in by_session.items():
        first_replica[group_of[sid]][reps[0]] += 1
    # what the slowest 10% of TTFTs were: turns that changed replica (recompute the history), first turns, others
    moved: dict[int, bool] = {}
    last: dict[str, str] = {}
    for r in sorted(run.results, key=lambda r: (r.session or "", r.turn)):
        if r.session:
            moved[r.index] = r.turn > 0 and last.get(r.session) not in (None, r.replica)
            last[r.session] = r.replica or ""
    ok = [r for r in run.results if r.ok and r.ttft is not None]
    ok.sort(key=lambda r: -(r.ttft or 0))
    top = ok[: max(1, len(ok) // 10)] if ok else []

    def uncached(rs: list[Any]) -> float:
        vals = [(r.prompt_tokens or 0) - (r.cached_tokens or 0) for r in rs]
        return statistics.mean(vals) if vals else 0.0

    def mean_ms(rs: list[Any]) -> float:
        return 1000 * statistics.mean(r.ttft for r in rs) if rs else 0.0

    tail = {"n": len(top), "switched": sum(1 for r in top if moved.get(r.index)),
            "first_turns": sum(1 for r in top if r.turn == 0),
            "stayed": sum(1 for r in top if r.turn > 0 and not moved.get(r.index)),
            "mean_uncached": uncached(top), "mean_uncached_all": uncached(ok),
            "ttft_switched_ms": mean_ms([r for r in ok if moved.get(r.index)]),
            "ttft_stayed_ms": mean_ms([r for r in ok if r.turn > 0 and not moved.get(r.index)]),
            "ttft_first_ms": mean_ms([r for r in ok if r.turn == 0])}
    return {
        "ttft_tail": tail,
        "session_switch_rate": switches / turns if turns else 0.0,
        "mean_replicas_per_session": statistics.mean(distinct) if distinct else 0.0,
        "requests_by_replica_and_group": {rep: dict(c) for rep, c in sorted(groups_on.items())},
        "sessions_started_on": {g: dict(c) for g, c in sorted(first_replica.items())},
    }


def _row(mode: str, report: dict[str, Any]) -> dict[str, Any]:
    o = report["overall"]
    cache = report.get("prefix_cache") or {}
    return {
        "mode": mode,
        "hit_rate": cache.get("rate"),
        "oracle_session": (report.get("oracle") or {}).get("session"),
        "oracle_global": (report.get("oracle") or {}).get("global"),
        "ttft_p50": o["ttft_ms"]["p50"], "ttft_p95": o["ttft_ms"]["p95"], "ttft_p99": o["ttft_ms"]["p99"],
        "e2el_p95": o["e2el_ms"]["p95"],
        "req_s": o["request_throughput"], "out_tok_s": o["output_throughput"],
        "max_over_mean": report["routing"]["max_over_mean_requests"],
        "max_over_mean_tokens": report["routing"]["max_over_mean_prompt_tokens"],
        "completed": o["completed"], "failed": o["failed"], "sent": report["sent"],
        "goodput_share": (o.get("goodput") or {}).get("share"),
        "preemptions": cache.get("preemptions"),
    }


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and key != "mode":
            vals = [r[key] for r in rows if r.get(key) is not None]
            med = statistics.median(vals) if vals else None
            out[key] = int(med) if isinstance(value, int) and med is not None and med == int(med) else med
    return out


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | hit rate (replicas) | oracle (session / global) | TTFT p50 / p95 / p99 ms | E2E p95 ms | req/s "
             "| out tok/s | max/mean load (req / tok) | ok / sent | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {_fmt(r['hit_rate'], '.1%')} | {_fmt(r['oracle_session'], '.1%')} / "
            f"{_fmt(r['oracle_global'], '.1%')} | {_fmt(r['ttft_p50'], '.0f')} / {_fmt(r['ttft_p95'], '.0f')} / "
            f"{_fmt(r['ttft_p99'], '.0f')} | {_fmt(r['e2el_p95'], '.0f')} | {_fmt(r['req_s'], '.2f')} | "
            f"{_fmt(r['out_tok_s'], '.0f')} | {_fmt(r['max_over_mean'], '.2f')} / "
            f"{_fmt(r['max_over_mean_tokens'], '.2f')} | {r['completed']} / {r['sent']} | "
            f"{_fmt(r['preemptions'], '.0f')} |")
    return "\n".join(lines)


def checks(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    if "prefix_affinity" not in rows or "round_robin" not in rows:
        return [{"name": "checks need round_robin and prefix_affinity runs", "value": "skipped", "ok": False}]
    pa, rr = rows["prefix_affinity"], rows["round_robin"]
    out = []
    oracle = pa["oracle_session"]
    hit = pa["hit_rate"]
    out.append({"name": "prefix_affinity hit rate ≥ 0.95 × oracle (session)",
                "value": f"{_fmt(hit, '.1%')} vs 0.95 × {_fmt(oracle, '.1%')} = "
                         f"{_fmt(0.95 * oracle if oracle else None, '.1%')}",
                "ok": hit is not None and oracle is not None and hit >= 0.95 * oracle})
    p95, rr95 = pa["ttft_p95"], rr["ttft_p95"]
    out.append({"name": "prefix_affinity TTFT p95 ≤ 0.5 × round_robin's",
                "value": f"{_fmt(p95, '.0f')} ms vs 0.5 × {_fmt(rr95, '.0f')} ms "
                         f"(ratio {_fmt(p95 / rr95 if p95 and rr95 else None, '.2f')})",
                "ok": p95 is not None and rr95 is not None and p95 <= 0.5 * rr95})
    mm = pa["max_over_mean"]
    out.append({"name": "prefix_affinity: no replica above 1.5 × mean load (requests)",
                "value": f"max/mean {_fmt(mm, '.2f')} (prompt tokens {_fmt(pa['max_over_mean_tokens'], '.2f')})",
                "ok": mm is not None and mm <= 1.5})
    failed = sum(r["failed"] for r in rows.values())
    out.append({"name": "no failed requests in any mode", "value": str(failed), "ok": failed == 0})
    return out


def serve_patched(config_path: str, port: int, params_json: str) -> int:
    """An experiment, not a change: run the gateway with ChoiceParams overridden (e.g. load_epsilon) by wrapping the
    build_policy the gateway imported, to test a suggested fix without editing policies/."""
    import gateway.runtime as app
    from gateway.server import serve

    overrides = json.loads(params_json)
    original = app.build_policy

    def patched(name: Any, **kwargs: Any) -> Any:
        return original(name, **kwargs, **overrides) if name != "round_robin" else original(name, **kwargs)

    app.build_policy = patched  # type: ignore[assignment]
    return serve(config_path, "127.0.0.1", port)


def run_level(plan: Plan, speed: float, *, quick: bool, rounds: int, modes: tuple[str, ...], kv_blocks: int,
              folder: Path, progress: bool | None, policy_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """All modes at one load level (the replicas' --speed: lower = slower replicas = heavier load)."""
    sim_args = [*SIM_ARGS, "--kv-blocks", str(kv_blocks), "--speed", str(speed)]
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    extras: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with sim_pool(REPLICAS, 32768, sim_args) as pool:
        for rnd in range(rounds):
            order = modes if rnd % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                pool.reset()
                sub = folder / f"speed{speed:g}-{mode}-r{rnd}"
                t = time.monotonic()
                if mode == "direct":
                    report, run_out = execute(plan, Target(replicas=pool.urls), replicas=pool.urls, out_dir=sub,
                                              quiet=True, progress=progress, plots=not quick)
                    reasons: dict[str, float] = {}
                else:
                    cfg = gateway_config(pool.urls, policy=mode, max_model_len=32768)
                    wrapper = (("loadtests.bench.policies", "--serve-patched", json.dumps(policy_params))
                               if policy_params else None)
                    with GatewayProc(cfg, serve_module=wrapper) as gw:
                        wait_gateway_sees(gw.url, REPLICAS)
                        time.sleep(0.6)  # one scrape of /metrics, so the gateway knows the KV sizes
                        report, run_out = execute(plan, Target(gateway=gw.url), replicas=pool.urls, out_dir=sub,
                                                  quiet=True, progress=progress, plots=not quick)
                        reasons = routing_reasons(gw.url)
                row = _row(mode, report)
                per_mode[mode].append(row)
                diag = diagnostics(run_out, plan)
                diag["routing_reasons"] = reasons
                diag["sim_stats"] = [{k: s.get(k) for k in ("completed", "tokens_in", "cached_tokens",
                                                             "preemptions", "prefix_cached_blocks")}
                                     for s in pool.stats()]
                extras[mode].append(diag)
                print(f"  speed {speed:g} round {rnd + 1} {mode:16s} hit {_fmt(row['hit_rate'], '.1%')}  TTFT p50/p95 "
                      f"{_fmt(row['ttft_p50'], '.0f')}/{_fmt(row['ttft_p95'], '.0f')} ms  max/mean "
                      f"{_fmt(row['max_over_mean'], '.2f')}  {row['completed']}/{row['sent']} ok  "
                      f"({time.monotonic() - t:.0f} s)", flush=True)
    rows = {m: _median_rows(v) for m, v in per_mode.items()}
    return {"speed": speed, "rows": rows, "per_round": per_mode, "diagnostics": extras, "checks": checks(rows),
            "sim_args": sim_args}


def run(quick: bool, rounds: int, workload: str | None, out_root: Path | None, progress: bool | None,
        speeds: tuple[float, ...], modes: tuple[str, ...] = MODES, kv_blocks: int = KV_BLOCKS,
        policy_params: dict[str, Any] | None = None) -> dict[str, Any]:
    plan = load_workload(workload) if workload else build_plan(agent_spec(quick), source="bench_policies")
    structure = token_structure(plan)
    oracle_full = oracle_hit_rates(plan, structure=structure)
    folder = out_root or run_dir("policies")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"workload {plan.name}: {len(plan.items)} requests in {len(plan.sessions())} sessions, "
          f"{sum(structure.tokens)} prompt tokens; oracle hit rate {oracle_full['session']:.1%} (session), "
          f"{oracle_full['global']:.1%} (global); {REPLICAS} replicas × {kv_blocks} KV blocks; replica speed(s) "
          f"{', '.join(f'{s:g}' for s in speeds)}", flush=True)
    if policy_params:
        print(f"EXPERIMENT: least_loaded/prefix_affinity run with ChoiceParams overrides {policy_params}", flush=True)
    levels = [run_level(plan, s, quick=quick, rounds=rounds, modes=modes, kv_blocks=kv_blocks, folder=folder,
                        progress=progress, policy_params=policy_params) for s in speeds]
    result = {"workload": plan.summary(), "oracle": oracle_full, "rounds": rounds, "levels": levels,
              "folder": str(folder), "replicas": REPLICAS, "kv_blocks": kv_blocks, "modes": list(modes),
              "policy_params": policy_params or {}}
    (folder / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    text = summary_text(result)
    (folder / "summary.md").write_text(text)
    print(text)
    print(f"results: {folder}")
    return result


def summary_text(result: dict[str, Any]) -> str:
    lines: list[str] = []
    for level in result["levels"]:
        rows = level["rows"]
        experiment = f"; EXPERIMENT ChoiceParams {result['policy_params']}" if result.get("policy_params") else ""
        lines += [f"## Routing policies at replica speed {level['speed']:g} ({result['rounds']} round(s), medians; "
                  f"{result['replicas']} simulated replicas × {result['kv_blocks']} KV blocks{experiment})", "",
                  table([rows[m] for m in result["modes"]]), ""]
        rr95 = rows["round_robin"]["ttft_p95"] if "round_robin" in rows else None
        lines.append("TTFT p95 relative to round_robin: " + ", ".join(
            f"{m} {_fmt(rows[m]['ttft_p95'] / rr95 if rows[m]['ttft_p95'] and rr95 else None, '.2f')}"
            for m in result["modes"]))
        lines.append("")
        for c in level["checks"]:
            lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['value']}")
        lines.append("")
        diag = (level["diagnostics"].get("prefix_affinity") or [{}])[-1]
        if diag:
            lines.append("prefix_affinity diagnostics (last round):")
            lines.append(f"  routing reasons (gateway /metrics): {diag.get('routing_reasons') or 'n/a'}")
            lines.append(f"  a session changed replica on {diag['session_switch_rate']:.1%} of its turns; "
                         f"{diag['mean_replicas_per_session']:.2f} replicas per session on average")
            tail = diag.get("ttft_tail") or {}
            if tail:
                lines.append(f"  slowest 10% TTFT ({tail['n']} requests): {tail['switched']} on a turn that changed "
                             f"replica, {tail['first_turns']} first turns, {tail['stayed']} stayed; mean uncached "
                             f"prompt tokens {tail['mean_uncached']:.0f} (all requests "
                             f"{tail['mean_uncached_all']:.0f})")
                lines.append(f"  mean TTFT: turns that changed replica {tail['ttft_switched_ms']:.0f} ms, turns that "
                             f"stayed {tail['ttft_stayed_ms']:.0f} ms, first turns {tail['ttft_first_ms']:.0f} ms")
            lines.append(f"  sessions' first replica by system prompt: {diag['sessions_started_on']}")
            lines.append(f"  requests by replica and system prompt: {diag['requests_by_replica_and_group']}")
            lines.append(f"  replicas' own counters: {diag['sim_stats']}")
            lines.append("")
    return "\n".join(lines) + "\n"


def results_of(result: dict[str, Any], args: argparse.Namespace) -> Results:
    """Per load level: prefix_affinity's hit rate beside the oracle's and its TTFT p95 beside round_robin's (the
    targets), its busiest replica over the mean, and the failed requests, in the one results format."""
    results = Results("policies", vars(args), reference="round_robin and the oracle's hit rate, same run")
    for level in result["levels"]:
        rows, at = level["rows"], f"speed {level['speed']:g}"
        if "prefix_affinity" not in rows or "round_robin" not in rows:
            continue
        pa, rr = rows["prefix_affinity"], rows["round_robin"]
        hit, oracle = pa["hit_rate"], pa["oracle_session"]
        results.add(f"prefix_affinity hit rate, {at}", None if hit is None else 100 * hit, "%",
                    reference="oracle (session)", reference_value=None if oracle is None else 100 * oracle,
                    goal="≥ 0.95 × the oracle", passed=hit is not None and oracle is not None and hit >= 0.95 * oracle)
        p95, rr95 = pa["ttft_p95"], rr["ttft_p95"]
        results.add(f"prefix_affinity TTFT p95, {at}", p95, "ms", reference="round_robin", reference_value=rr95,
                    goal="≤ 0.5 × round_robin's", passed=p95 is not None and rr95 is not None and p95 <= 0.5 * rr95)
        results.add(f"prefix_affinity busiest replica / mean (requests), {at}", pa["max_over_mean"], "×",
                    at_most=1.5)
        results.add(f"failed requests, every mode, {at}", sum(r["failed"] for r in rows.values()), "requests",
                    at_most=0)
    return results


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--serve-patched":
        return serve_patched(argv[1], int(argv[2]), argv[3])
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.policies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter trace (for make bench)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are compared")
    parser.add_argument("--workload", help="a workload YAML instead of the built-in agent trace")
    parser.add_argument("--speeds", type=float, nargs="+",
                        help="the replicas' --speed per load level (lower = heavier load); default 0.8 with "
                             "--quick, else 1.0 and 0.7")
    parser.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help="KV blocks per simulated replica")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="subset of modes (round_robin and prefix_affinity are needed for the checks)")
    parser.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                        help="EXPERIMENT: override a policies.replica_choice.ChoiceParams field in the gateways "
                             "(e.g. load_epsilon=1.0) without editing the policy")
    parser.add_argument("--out", help="results folder")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    # the quick trace is shorter than the full one (sessions cut at 25 s); slightly slower replicas give it about the
    # load per replica the full trace has at speed 1 (round_robin queueing, TTFT p95 above a second)
    speeds = tuple(args.speeds or ((0.8,) if args.quick else (1.0, 0.7)))
    params = {k: json.loads(v) for k, _, v in (p.partition("=") for p in args.policy_param)}
    result = run(args.quick, args.rounds, args.workload, Path(args.out) if args.out else None, args.progress,
                 speeds, tuple(args.modes), args.kv_blocks, params)
    results_of(result, args).write(Path(result["folder"]))
    return 0 if all(c["ok"] for level in result["levels"] for c in level["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
