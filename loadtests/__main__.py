"""`python -m loadtests`: run workloads, replay traces, compare routing policies, measure gateway overhead.

    python -m loadtests list                              workloads shipped in loadtests/lib/workloads/
    python -m loadtests plan agent                        what a workload will send (and its oracle hit rates)
    python -m loadtests run smoke                         start simulated replicas + a gateway, run, report
    python -m loadtests run mixed --gateway http://127.0.0.1:8080
    python -m loadtests run agent --replicas http://127.0.0.1:8001 http://127.0.0.1:8002   (client round robin)
    python -m loadtests run smoke --contract              the operating contract checked against the run
    python -m loadtests run mixed --gateway URL --contract pools.yaml
    python -m loadtests replay trace.jsonl --time-scale 0.5 --gateway URL
    python -m loadtests trace agent -o agent.jsonl        write the plan as a replayable trace
    python -m loadtests policies [--quick]                = python -m loadtests.bench.policies
    python -m loadtests overhead [--quick]                = python -m loadtests.bench.overhead
    python -m loadtests bench [--quick]                   the main benchmarks, one table of their figures (`make bench`)
    python -m loadtests bench --list                      every benchmark (python -m loadtests.bench.NAME)

Results go to loadtests/results/<time>-<name>/: report.json, report.md, results.jsonl, trace.jsonl, *.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from loadtests.lib.client import Target
from loadtests.lib.oracle import trace_records
from loadtests.lib.workload import WORKLOAD_DIR, WorkloadError, build_plan, load_workload


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def cmd_list(args: argparse.Namespace) -> int:
    for path in sorted(WORKLOAD_DIR.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text()) or {}
        description = str(spec.get("description") or "").strip().splitlines()
        print(f"{path.stem:32s} {description[0] if description else ''}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from loadtests.lib.oracle import oracle_hit_rates

    plan = load_workload(args.workload, _overrides(args.set))
    summary = plan.summary()
    summary["oracle"] = oracle_hit_rates(plan)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    plan = load_workload(args.workload, _overrides(args.set))
    items = sorted(plan.items, key=lambda i: (i.at, i.session or "", i.turn))
    with open(args.output, "w") as f:
        for rec in trace_records(items):
            f.write(json.dumps(rec) + "\n")
    print(f"{len(items)} records → {args.output}")
    return 0


def _run(plan: Any, args: argparse.Namespace) -> int:
    from loadtests.lib.harness import execute as run_plan_once, gateway_replicas, run_dir
    from loadtests.lib.replicas import gateway, gateway_config, sim_pool

    out = None if args.no_write else (Path(args.out) if args.out else run_dir(args.name or plan.name))
    verdict = {"rc": 0}

    def execute(plan: Any, target: Target, *, config: Any = None, **kw: Any) -> None:
        """One run; with --contract, the operating contract checked against it (exit 1 on a failed target)."""
        if args.contract is None:
            run_plan_once(plan, target, **kw)
            return
        from loadtests.lib.contract_check import check_run, scrape_stages
        from policies.config import load_config
        from policies.contract import passed, to_markdown

        if args.contract:
            config = load_config(args.contract)
        if config is None:
            raise WorkloadError("--contract needs the gateway's pool file here (--contract pools.yaml)")
        before = scrape_stages(target.gateway)
        _, run = run_plan_once(plan, target, **kw)
        contract = check_run(config, run.results, before, scrape_stages(target.gateway),
                             f"load test `{plan.name}` ({len(run.results)} requests)", out)
        print(to_markdown(contract))
        verdict["rc"] = 0 if passed(contract) else 1

    kwargs: dict[str, Any] = dict(duration_s=args.duration, max_requests=args.max_requests,
                                  max_concurrency=args.max_concurrency, out_dir=out, plots=not args.no_plots,
                                  progress=args.progress)
    if args.drain is not None:
        kwargs["drain_s"] = args.drain
    if args.gateway or args.replicas:
        if args.gateway:
            replicas = args.replicas or gateway_replicas(args.gateway, args.admin_key)
            target = Target(gateway=args.gateway)
        else:
            replicas = args.replicas
            target = Target(replicas=replicas)
        execute(plan, target, replicas=replicas, **kwargs)
        return verdict["rc"]
    # self-contained: simulated replicas (+ a gateway unless --direct)
    sim_args = shlex.split(args.sim_args)
    images = any(i.images for i in plan.items)
    if images and "--modalities" not in sim_args:
        sim_args += ["--modalities", "text,image"]
    with sim_pool(args.sims, args.max_model_len, sim_args) as pool:
        if args.direct:
            execute(plan, Target(replicas=pool.urls), replicas=pool.urls, **kwargs)
            return 0
        cfg = gateway_config(pool.urls, policy=args.policy, max_model_len=args.max_model_len,
                             modalities=("text", "image") if images else ("text",))
        if args.contract_targets:
            cfg["traffic"] = {"classes": {"interactive": {"targets": yaml.safe_load(args.contract_targets)}}}
        with gateway(cfg) as gw:
            execute(plan, Target(gateway=gw.url), replicas=pool.urls, config=cfg, **kwargs)
    return verdict["rc"]


def cmd_run(args: argparse.Namespace) -> int:
    plan = load_workload(args.workload, _overrides(args.set))
    return _run(plan, args)


def cmd_replay(args: argparse.Namespace) -> int:
    trace: dict[str, Any] = {"path": str(Path(args.trace).resolve()), "time_scale": args.time_scale}
    if args.max_records:
        trace["max_records"] = args.max_records
    if args.time_unit:
        trace["time_unit"] = args.time_unit
    spec: dict[str, Any] = {"name": args.name or Path(args.trace).stem, "trace": trace, "seed": args.seed,
                            "stream": True, **_overrides(args.set)}
    plan = build_plan(spec, source=args.trace)
    return _run(plan, args)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (default: start simulated replicas and a gateway here)")
    g.add_argument("--gateway", help="gateway base URL (http://127.0.0.1:8080)")
    g.add_argument("--replicas", nargs="+", default=[], help="replica URLs: metrics source; alone = direct, client "
                                                             "round robin")
    g.add_argument("--admin-key", help="the gateway's admin key, to list its replicas")
    g.add_argument("--sims", type=int, default=2, help="simulated replicas to start (no --gateway/--replicas)")
    g.add_argument("--sim-args", default="--speed 10", help="extra `m3gate sim` flags for them")
    g.add_argument("--max-model-len", type=int, default=32768)
    g.add_argument("--policy", default="prefix_affinity", choices=["round_robin", "least_loaded", "prefix_affinity"])
    g.add_argument("--direct", action="store_true", help="with started sims: no gateway, client round robin")
    r = p.add_argument_group("run")
    r.add_argument("--duration", type=float, help="stop issuing after this many seconds (overrides the workload)")
    r.add_argument("--max-requests", type=int, help="stop issuing after this many requests")
    r.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    r.add_argument("--drain", type=float, help="seconds to wait for requests in flight after issuing stops")
    r.add_argument("--set", action="append", default=[], metavar="KEY=YAML", help="override a top-level workload key")
    r.add_argument("--name", help="run name (results folder suffix)")
    r.add_argument("--out", help="results folder (default loadtests/results/<time>-<name>)")
    r.add_argument("--no-write", action="store_true", help="print the report only")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--contract", nargs="?", const="", default=None, metavar="POOLS_YAML",
                   help="check the operating contract (traffic.classes.*.targets) against this run; the pool file "
                   "is needed with --gateway, else the started gateway's config is used. Exit 1 on a failure")
    r.add_argument("--contract-targets", metavar="YAML", help="targets for the started gateway's one class "
                   "(interactive), e.g. '{ttft_ms: {p50: 100, p95: 500}, tpot_ms: {p95: 40}}'")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="workloads shipped with the harness").set_defaults(fn=cmd_list)
    p = sub.add_parser("plan", help="summarise a workload's plan and oracle hit rates")
    p.add_argument("workload")
    p.add_argument("--set", action="append", default=[])
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("trace", help="write a workload's plan as a replayable JSONL trace")
    p.add_argument("workload")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--set", action="append", default=[])
    p.set_defaults(fn=cmd_trace)
    p = sub.add_parser("run", help="run a workload")
    p.add_argument("workload", help="a YAML path or a name from `list`")
    _add_target_args(p)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("replay", help="replay a JSONL trace (Mooncake or m3gate format)")
    p.add_argument("trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply timestamps (0.5 = twice as fast)")
    p.add_argument("--time-unit", choices=["s", "ms"], help="timestamp unit (default: ms for hash_ids, else s)")
    p.add_argument("--max-records", type=int)
    p.add_argument("--seed", type=int, default=0)
    _add_target_args(p)
    p.set_defaults(fn=cmd_replay)
    for name, module in (("policies", "loadtests.bench.policies"), ("overhead", "loadtests.bench.overhead"),
                         ("bench", "loadtests.bench.__main__")):
        p = sub.add_parser(name, help=f"= python -m {module.removesuffix('.__main__')}", add_help=False)
        p.set_defaults(fn=None, module=module)
    args, rest = parser.parse_known_args(argv)
    if args.fn is None:
        import importlib

        return int(importlib.import_module(args.module).main(rest) or 0)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.fn(args) or 0)
    except WorkloadError as exc:
        print(f"workload error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
