"""Prefix routing under load, on the peers' own benchmark shape, beside SGLang's Rust router on the same replicas.

    python -m loadtests.bench.prefix_load [--quick] [--rates 2.5 5 7.5] [--variants uniform hot] [--rounds N]
                                          [--routers m3gate sglang ...]

The workload is inference-perf's `shared_prefix` shape (the one the Kubernetes inference stack publishes to judge
prefix-aware routing) at a size where the cache matters: 24 groups × 5 prompts, each a 6,000-token system prompt
shared by its group plus a unique 1,200-token question, 100 output tokens, streaming chat, shuffled, Poisson
arrivals. Four simulated replicas (`m3gate sim`, the default 4-bytes-per-token tokenizer) whose KV cache holds about
10 of the 24 prefixes each (560 blocks of 128 tokens); a prefill costs 120 µs per uncached token, so a miss costs
~0.87 s and a hit ~0.16 s; the pool saturates near 8–9 requests/s. The `hot` variant (240 requests) sends half of them
to one group, the rest spread over the other 23, at 10 requests/s: the hot group's hits alone are more than one
replica prefills, the case where a prefix needs a second home and a rule that never moves is wrong.

Routers, each on the same arrivals, the replicas' caches and counters reset before every run, rounds interleaved
(round k on its own arrivals, seed 11 + k):
- `m3gate`: `routing.policy: prefix_affinity` (its defaults);
- `sglang`: SGLang's Rust router, `--policy cache_aware` with its defaults (stay on the longest match unless the
  load imbalance exceeds 64 requests and 1.5×), in its own virtualenv (loadtests/lib/peers.py);
- `never_move`: m3gate's prefix affinity with moves off (`routing.placement.move_cost_factor: .inf`, the bounded-load
  rule opened: `load_epsilon: 10`, `load_slack: 1000`): every request follows its prefix's placement whatever the
  load, the rule the `hot` variant is judged against;
- `round_robin`: m3gate's cache-blind baseline.

Printed per run and as medians: the prefix-cache hit rate from the replicas' own counters and as a share of the oracle
(each group always on one replica, unlimited cache: the plan's token structure), TTFT p50/p90/p99, completed
requests per second, repeat requests that missed (their group had been sent before, yet the replica reported under
a block of cached prefix), and for m3gate the routing reasons and how many replicas served each group. Checks (the
issue's goals): m3gate's hit rate ≥ 0.97 × the oracle at every rate below saturation, TTFT p50 and p90 ≤ SGLang's,
completed req/s ≥ SGLang's at the highest rate; in the hot variant TTFT p90 ≤ 0.8 × never_move's. `--quick`: the
uniform variant at 5 req/s and the hot one, one round (about 4 minutes). Results in `--out`, by default
loadtests/results/<time>-prefix-load/: results.json (every check a figure with its goal, each router's hit rate
beside the oracle's; loadtests/lib/results.py), summary.json, summary.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.lib.client import Target
from loadtests.lib.harness import execute, run_dir
from loadtests.lib.replicas import gateway, sim_pool, wait_gateway_sees
from loadtests.lib.report import median_rows, routing_reasons
from loadtests.lib.results import Results
from loadtests.lib.workload import Item, Plan, _assign_arrivals, build_plan

MODEL = "MiniMaxAI/MiniMax-M3"
REPLICAS = 4
KV_BLOCKS = 560  # ~10 of the 24 prefixes (47 blocks each) plus the running requests' questions
ROUTERS = ("m3gate", "sglang", "never_move", "round_robin")
DEFAULT_ROUTERS = {"uniform": ("m3gate", "sglang"), "hot": ("m3gate", "sglang", "never_move")}
SIM_ARGS = ["--kv-blocks", str(KV_BLOCKS), "--max-num-seqs", "32", "--prefill-us-per-token", "120",
            "--decode-ms-per-step", "12", "--mean-output-tokens", "0", "--tool-call-probability", "0",
            "--adaptive-thinking-probability", "0"]
HIT_GOAL = 0.97  # × the oracle, at every rate below saturation
HOT_GOAL = 0.8  # hot variant: TTFT p90 ≤ 0.8 × never_move's
ROUTING_OVERRIDES: dict[str, Any] = {}  # --routing: m3gate's `routing` keys for this run (trying a setting)


@dataclass(frozen=True)
class Shape:
    """inference-perf's shared_prefix shape; `hot_share` of the requests go to group 0."""

    groups: int = 24
    per_group: int = 5
    prefix_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 100
    hot_share: float = 0.0
    seed: int = 11

    def plan(self, rate: float) -> Plan:
        total = self.groups * self.per_group
        hot = round(total * self.hot_share)
        per_group = max(self.per_group, hot)
        spec = {"name": f"shared-prefix-{'hot' if hot else 'uniform'}-{rate:g}", "seed": self.seed, "drain_s": 120,
                "shape": {"name": "inference_perf_shared_prefix", "num_groups": self.groups,
                          "num_prompts_per_group": per_group, "system_prompt_len": self.prefix_tokens,
                          "question_len": self.question_tokens, "output_len": self.output_tokens, "api": "chat"}}
        plan = build_plan(spec, source="bench_prefix_load")
        items = plan.items
        if hot:
            items = _pick(items, self.groups, hot, total)
            random.Random(self.seed).shuffle(items)  # the picks come in build order: the other groups' first
        _assign_arrivals(items, {"process": "poisson", "rate": rate}, random.Random(self.seed * 1000 + int(rate * 10)))
        for k, item in enumerate(items):
            item.index = k
        plan.items = items
        return plan


def _pick(items: Sequence[Item], groups: int, hot: int, total: int) -> list[Item]:
    """`hot` requests of group 0, the other `total - hot` spread evenly over the other groups."""
    rest = total - hot
    quota = {f"inference_perf_shared_prefix/g{g}": rest // (groups - 1) + (1 if g <= rest % (groups - 1) else 0)
             for g in range(1, groups)}
    quota["inference_perf_shared_prefix/g0"] = hot
    out = []
    for item in items:
        left = quota.get(item.prefix_group or "", 0)
        if left:
            quota[item.prefix_group or ""] = left - 1
            out.append(item)
    return out


def gateway_config(urls: Sequence[str], router: str, routing_overrides: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    routing: dict[str, Any] = {"policy": "round_robin" if router == "round_robin" else "prefix_affinity"}
    if router == "m3gate":
        routing.update(routing_overrides or {})
    if router == "never_move":  # no move for load, no bounded-load spill
        routing.update(placement={"move_cost_factor": float("inf")}, load_epsilon=10.0, load_slack=1000.0)
    return {
        "model": MODEL,
        "pools": [{"name": "bench", "max_model_len": 16384, "endpoints": list(urls)}],
        "routing": routing,
        "server": {"health_interval_s": 0.5},
        "admin": {"watch_config": False},
        "traffic": {"classes": {"default": {"max_concurrency": 1024, "queue_length": 1024, "max_queue_wait_s": 600}},
                    "saturation": {"max_waiting": None, "max_kv_usage": None}},
    }


def group_stats(results: Sequence[Any], prefix_tokens: int) -> dict[str, Any]:
    """Repeat requests that missed (cached under one block of the shared prefix although the group was sent before)
    and, where the gateway names the replica, how many replicas served each group and the share on its main one."""
    seen: set[str] = set()
    repeats = missed = 0
    per_group: dict[str, dict[str, int]] = {}
    for r in sorted(results, key=lambda r: r.t_send):
        g = r.prefix_group
        if g is None or not r.ok:
            continue
        if g in seen:
            repeats += 1
            missed += 1 if (r.cached_tokens or 0) < prefix_tokens - 128 else 0
        seen.add(g)
        if r.replica:
            counts = per_group.setdefault(g, {})
            counts[r.replica] = counts.get(r.replica, 0) + 1
    spread = [len(c) for c in per_group.values()]
    main = [max(c.values()) / sum(c.values()) for c in per_group.values()]
    return {"repeats": repeats, "repeats_missed": missed,
            "replicas_per_group": statistics.mean(spread) if spread else None,
            "main_replica_share": statistics.mean(main) if main else None}


def _row(router: str, report: Mapping[str, Any], results: Sequence[Any], oracle: float, prefix_tokens: int,
         reasons: Mapping[str, float]) -> dict[str, Any]:
    o = report["overall"]
    hit = (report.get("prefix_cache") or {}).get("rate")
    ttfts = [r.ttft * 1000.0 for r in results if r.ok and r.ttft is not None]
    p50, p90, p99 = (float(v) for v in np.percentile(ttfts, [50, 90, 99])) if ttfts else (None, None, None)
    return {"router": router, "hit_rate": hit, "of_oracle": hit / oracle if hit is not None and oracle else None,
            "ttft_p50": p50, "ttft_p90": p90, "ttft_p99": p99,
            "req_s": o["request_throughput"], "completed": o["completed"], "failed": o["failed"],
            "sent": report["sent"], **group_stats(results, prefix_tokens), "reasons": dict(reasons)}


def run_one(router: str, plan: Plan, urls: Sequence[str], folder: Path, oracle: float, shape: Shape,
            progress: bool | None) -> dict[str, Any]:
    """One router through the plan on replicas just reset."""
    from loadtests.lib.peers import start_peer

    with ExitStack() as stack:
        reasons_url = None
        if router == "sglang":
            peer = start_peer("sglang-router:cache_aware", urls, timeout_s=60.0)
            stack.callback(peer.stop)
            url = peer.url
        else:
            gw = stack.enter_context(gateway(gateway_config(urls, router, ROUTING_OVERRIDES)))
            wait_gateway_sees(gw.url, REPLICAS)
            time.sleep(1.5)  # one /metrics scrape: the replicas' KV sizes
            url = reasons_url = gw.url
        report, out = execute(plan, Target(gateway=url), replicas=urls, out_dir=folder, quiet=True,
                              progress=progress, plots=False, oracle=False)
        reasons = routing_reasons(reasons_url) if reasons_url else {}
    return _row(router, report, out.results, oracle, shape.prefix_tokens, reasons)


def run_variant(variant: str, shape: Shape, rates: Sequence[float], routers: Sequence[str], rounds: int,
                folder: Path, progress: bool | None) -> dict[str, Any]:
    """Every rate × router, rounds interleaved (odd rounds in reverse order); medians per (rate, router). Round k
    draws its order and arrivals from seed `shape.seed + k` (the replicas are deterministic: a round repeated on
    the same arrivals repeats itself), so the medians are over different arrivals, each router on the same ones."""
    from loadtests.lib.oracle import oracle_hit_rates

    per: dict[str, dict[str, list[dict[str, Any]]]] = {f"{r:g}": {x: [] for x in routers} for r in rates}
    oracle_runs: dict[str, list[float]] = {f"{r:g}": [] for r in rates}
    with sim_pool(REPLICAS, 16384, SIM_ARGS) as pool:
        for rnd in range(rounds):
            for rate in rates:
                plan = replace(shape, seed=shape.seed + rnd).plan(rate)  # each round its own order and arrivals
                oracle = oracle_hit_rates(plan)["session"]
                oracle_runs[f"{rate:g}"].append(oracle)
                for router in (routers if rnd % 2 == 0 else tuple(reversed(routers))):
                    pool.reset()
                    started = time.monotonic()
                    row = run_one(router, plan, pool.urls, folder / f"{variant}-{rate:g}-{router}-r{rnd}", oracle,
                                  shape, progress)
                    per[f"{rate:g}"][router].append(row)
                    print(f"  {variant} {rate:g}/s round {rnd + 1} {router:11s} {_line(row)} "
                          f"({time.monotonic() - started:.0f} s)", flush=True)
    rows = {rate: {router: median_rows(v) for router, v in by.items()} for rate, by in per.items()}
    oracles = {rate: statistics.median(v) for rate, v in oracle_runs.items()}
    return {"variant": variant, "shape": shape.__dict__, "oracle": oracles, "rows": rows, "per_round": per,
            "checks": checks(variant, rows)}


def _line(r: Mapping[str, Any]) -> str:
    return (f"hit {_fmt(r['hit_rate'], '.3f')} ({_fmt(r['of_oracle'], '.0%')} of oracle)  TTFT p50/p90/p99 "
            f"{_fmt(r['ttft_p50'], '.0f')}/{_fmt(r['ttft_p90'], '.0f')}/{_fmt(r['ttft_p99'], '.0f')} ms  "
            f"{_fmt(r['req_s'], '.2f')} req/s  {r['completed']}/{r['sent']} ok  missed repeats "
            f"{r['repeats_missed']}/{r['repeats']}  replicas/group {_fmt(r['replicas_per_group'], '.2f')}  "
            f"reasons {_reasons(r['reasons'])}")


def _reasons(reasons: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "–"


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _ok_le(a: Any, b: Any, factor: float = 1.0) -> bool:
    return a is not None and b is not None and a <= factor * b


def _check(name: str, value: Any, unit: str, ok: bool, goal: str, reference: str | None = None,
           reference_value: Any = None, text: str | None = None) -> dict[str, Any]:
    """One goal: its printed line (`value`) and the figure it becomes in results.json."""
    shown = text or f"{_fmt(value, '.0f')} vs {_fmt(reference_value, '.0f')} {unit}"
    return {"name": name, "value": shown, "ok": ok, "figure": value, "unit": unit, "goal": goal,
            "reference": reference, "reference_value": reference_value}


def checks(variant: str, rows: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's goals for one variant; a check whose router did not run is left out."""
    out: list[dict[str, Any]] = []
    rates = sorted(rows, key=float)
    for rate in rates:
        by = rows[rate]
        m, s, n = by.get("m3gate"), by.get("sglang"), by.get("never_move")
        if m is None:
            continue
        if variant == "uniform":
            out.append(_check(f"{rate}/s: m3gate hit rate ≥ {HIT_GOAL} × oracle", m["of_oracle"], "× oracle",
                              _ok_le(HIT_GOAL, m["of_oracle"]), f"≥ {HIT_GOAL} × oracle", "oracle",
                              text=_fmt(m["of_oracle"], ".3f")))
        if s is not None:
            for key in ("ttft_p50", "ttft_p90"):
                out.append(_check(f"{rate}/s: m3gate {key} ≤ SGLang's", m[key], "ms", _ok_le(m[key], s[key]),
                                  "≤ SGLang's", "SGLang router", s[key]))
            if rate == rates[-1]:
                out.append(_check(f"{rate}/s: m3gate completed req/s ≥ SGLang's", m["req_s"], "req/s",
                                  _ok_le(s["req_s"], m["req_s"], 1.0), "≥ SGLang's", "SGLang router", s["req_s"],
                                  text=f"{_fmt(m['req_s'], '.2f')} vs {_fmt(s['req_s'], '.2f')}"))
        if variant == "hot" and n is not None:
            out.append(_check(f"{rate}/s: m3gate TTFT p90 ≤ {HOT_GOAL} × never_move's", m["ttft_p90"], "ms",
                              _ok_le(m["ttft_p90"], n["ttft_p90"], HOT_GOAL), f"≤ {HOT_GOAL} × never_move's",
                              "never_move", n["ttft_p90"]))
    return out


def results_of(result: Mapping[str, Any], args: argparse.Namespace) -> Results:
    """Each router's hit rate (informational, beside the oracle) and every check as a figure with its goal, in the
    one results format."""
    results = Results("prefix_load", vars(args), reference="SGLang's Rust router (cache_aware) and never_move on "
                                                           "the same replicas and arrivals, same run")
    for name, v in result["variants"].items():
        for rate, by in v["rows"].items():
            for router, r in by.items():
                hit = r.get("hit_rate")
                results.add(f"[{name}] {rate}/s: {router} prefix-cache hit rate", None if hit is None else 100 * hit,
                            "%", reference="oracle", reference_value=100 * v["oracle"][rate])
        for c in v["checks"]:
            results.add(f"[{name}] {c['name']}", c["figure"], c["unit"], goal=c["goal"], passed=c["ok"],
                        reference=c["reference"], reference_value=c["reference_value"])
    return results


def summary_text(result: Mapping[str, Any]) -> str:
    lines = [f"## Prefix routing under load ({REPLICAS} simulated replicas × {KV_BLOCKS} KV blocks, "
             f"{result['rounds']} round(s), medians)", ""]
    for name, v in result["variants"].items():
        shape = Shape(**v["shape"])
        lines += [f"### {name}: {shape.groups} groups, {shape.prefix_tokens}-token prefix + {shape.question_tokens}"
                  f"-token question, {shape.output_tokens} output tokens"
                  + (f", {shape.hot_share:.0%} of requests on one group" if shape.hot_share else ""), "",
                  "| req/s | router | hit rate (× oracle) | TTFT p50 / p90 / p99 ms | completed req/s | "
                  "missed repeats | replicas per group | routing reasons |", "|---|---|---|---|---|---|---|---|"]
        for rate, by in v["rows"].items():
            for router, r in by.items():
                lines.append(f"| {rate} | {router} | {_fmt(r['hit_rate'], '.3f')} ({_fmt(r['of_oracle'], '.2f')}) | "
                             f"{_fmt(r['ttft_p50'], '.0f')} / {_fmt(r['ttft_p90'], '.0f')} / "
                             f"{_fmt(r['ttft_p99'], '.0f')} | {_fmt(r['req_s'], '.2f')} | {r['repeats_missed']} / "
                             f"{r['repeats']} | {_fmt(r['replicas_per_group'], '.2f')} | {_reasons(r['reasons'])} |")
        lines.append("")
        lines += [f"{'PASS' if c['ok'] else 'FAIL'}  [{name}] {c['name']}: {c['value']}" for c in v["checks"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.bench.prefix_load", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="uniform at 5/s and hot at 10/s, one round")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="arrival rates, req/s (default 2.5 5 7.5)")
    ap.add_argument("--hot-rates", type=float, nargs="+", default=None, help="the hot variant's rates (default 10)")
    ap.add_argument("--variants", nargs="+", choices=["uniform", "hot"], default=["uniform", "hot"])
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=None,
                    help="default: m3gate and sglang (uniform); + never_move (hot)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=Shape.seed, help="round k's arrivals come from seed + k")
    ap.add_argument("--routing", type=json.loads, default={}, metavar="JSON",
                    help='m3gate\'s routing settings for this run, e.g. \'{"placement": {"window_s": 3}}\'')
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args(argv)
    rates = args.rates or ([5.0] if args.quick else [2.5, 5.0, 7.5])
    hot_rates = args.hot_rates or [10.0]
    ROUTING_OVERRIDES.update(args.routing)
    folder = args.out or run_dir("prefix-load")
    folder.mkdir(parents=True, exist_ok=True)
    variants: dict[str, Any] = {}
    for variant in args.variants:
        shape = Shape(seed=args.seed) if variant == "uniform" else \
            Shape(seed=args.seed, per_group=10, hot_share=0.5)
        routers = tuple(args.routers or DEFAULT_ROUTERS[variant])
        variants[variant] = run_variant(variant, shape, rates if variant == "uniform" else hot_rates, routers,
                                        args.rounds, folder, args.progress)
    result = {"replicas": REPLICAS, "kv_blocks": KV_BLOCKS, "rounds": args.rounds, "variants": variants,
              "ok": all(c["ok"] for v in variants.values() for c in v["checks"])}
    (folder / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    text = summary_text(result)
    (folder / "summary.md").write_text(text)
    results_of(result, args).write(folder)
    print(text)
    print(f"results: {folder}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
