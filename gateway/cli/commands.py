"""`m3gate` console script: one entry, a subcommand per job. Subcommands import their module lazily so that
`m3gate sim` does not pay for the gateway's imports and vice versa."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _cmd_config_check(args: argparse.Namespace) -> int:
    from policies.config import ConfigError, load_config

    try:
        cfg = load_config(args.path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.path}: OK — model {cfg.model}, pools: "
          + ", ".join(f"{p.name} ({p.max_model_len} tokens, {_replicas(p)})" for p in cfg.pools_by_size()))
    return 0


def _replicas(pool: Any) -> str:
    d = pool.disaggregation
    if d is None:
        return f"{len(pool.endpoints)} endpoints"
    sides = [f"{len(side.endpoints) if not side.discovery else 'DNS'} {role}"
             for role, side in (("prefill", d.prefill), ("decode", d.decode))]
    return " + ".join(sides) + ", disaggregated"


def _cmd_config_schema(args: argparse.Namespace) -> int:
    from policies.config import json_schema

    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0


def _cmd_pools_render(args: argparse.Namespace) -> int:
    from policies.config import ConfigError, load_config
    from policies.launch import LaunchError, format_commands, render_config

    try:
        print(format_commands(render_config(load_config(args.path), args.pool), args.format), end="")
    except (ConfigError, LaunchError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def _cmd_contract(args: argparse.Namespace) -> int:
    from gateway.cli.contract import rules_yaml, write_contract
    from policies.config import ConfigError, load_config
    from policies.contract import build_contract, check, passed, to_markdown

    try:
        config = load_config(args.path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    contract = build_contract(config)
    if args.prometheus:
        from pools.prometheus import PrometheusError, observe_classes

        try:
            observed = observe_classes(args.prometheus, args.window, [c.name for c in contract.classes])
        except PrometheusError as exc:
            print(f"m3gate contract: {exc}", file=sys.stderr)
            return 2
        check(contract, observed, f"Prometheus {args.prometheus}, last {args.window}")
    if args.rules:
        with open(args.rules, "w") as f:
            f.write(rules_yaml(config))
        print(f"SLO rules: {args.rules}", file=sys.stderr)
    if args.out:
        paths = write_contract(contract, args.out)
        print("contract: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    if not args.out or args.prometheus:
        print(to_markdown(contract))
    return 1 if contract.verdicts and not passed(contract) else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from gateway.capacity.plan import ClassLoad, PlanError, learnt_costs, plan, read_trace, to_markdown, trace_loads
    from policies.capacity import EngineCosts
    from policies.config import ConfigError, load_config

    if (args.workload is None) == (args.prometheus is None):
        print("m3gate plan: give --workload FILE or --prometheus URL (one of them)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.path)
        if args.workload is not None:
            loads, source = trace_loads(config, read_trace(args.workload), args.peak_window_s)
        else:
            from pools.prometheus import PrometheusError, observe_demand

            try:
                observed = observe_demand(args.prometheus, args.window)
            except PrometheusError as exc:
                print(f"m3gate plan: {exc}", file=sys.stderr)
                return 2
            loads = {pool: {cls: ClassLoad(**d) for cls, d in classes.items()} for pool, classes in observed.items()}
            source = {"window": args.window, "peak_step": "1m"}
    except (ConfigError, PlanError) as exc:
        print(exc, file=sys.stderr)
        return 1
    costs = EngineCosts(args.prefill_step_ms / 1000, args.prefill_ms_per_1k / 1000, args.decode_step_ms / 1000,
                        args.decode_ms_per_seq / 1000, args.decode_ms_per_seq_1k / 1000)
    try:
        learnt = learnt_costs(json.loads(Path(args.costs).read_text())) if args.costs else None
    except (OSError, ValueError) as exc:  # PlanError and JSONDecodeError are ValueErrors
        print(f"m3gate plan: {exc}", file=sys.stderr)
        return 1
    result = plan(config, loads, costs, source, learnt)
    print(json.dumps(result, indent=2) if args.json else to_markdown(result, args.workload or args.prometheus),
          end="\n" if args.json else "")
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from pools.sim.cli import run

    return run(args)


def _add_sim(sub: argparse._SubParsersAction) -> None:
    from pools.sim.cli import add_arguments

    p = sub.add_parser("sim", help="run one simulated vLLM replica (MiniMax-M3 behaviour)",
                       description="A vLLM-faithful simulated replica: same endpoints, SSE, errors and /metrics.")
    add_arguments(p)
    p.set_defaults(func=_cmd_sim)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.server import serve

    return serve(args.config, host=args.host, port=args.port, worker=args.worker)


def _cmd_epp(args: argparse.Namespace) -> int:
    from gateway.epp.server import run_epp

    return run_epp(args.config, host=args.host, port=args.port, http_port=args.http_port,
                   response_processing=args.response_processing)


def _cmd_envoy_config(args: argparse.Namespace) -> int:
    from gateway.epp.envoy_config import envoy_bootstrap, envoy_yaml
    from policies.config import ConfigError, load_config

    try:
        text = envoy_yaml(envoy_bootstrap(load_config(args.path), args.epp, args.listen, fail_open=args.fail_open,
                                          admin=args.admin, response_processing=args.response_processing))
    except (ConfigError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


def _add_epp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("epp", help="run as a Gateway API Inference Extension endpoint picker (Envoy ext_proc)",
                       description="The gateway's decisions for an Envoy in front of the pools: ext_proc and gRPC "
                       "health on --port, the gateway's HTTP app (/metrics, /ui, /admin, /health) on --http-port.")
    p.add_argument("--config", required=True, help="pool config YAML")
    p.add_argument("--host", default="0.0.0.0", help="listen address of both ports (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=9002, help="ext_proc + gRPC health port (default 9002)")
    p.add_argument("--http-port", type=int, default=9003, help="HTTP port: metrics, status page, admin (9003)")
    p.add_argument("--response-processing", choices=["full", "none"], default="full",
                   help="full: Envoy streams responses through the picker (usage, token times, sessions, metrics); "
                   "none: requests only, cheaper (Envoy's config must match: envoy-config --response-processing)")
    p.set_defaults(func=_cmd_epp)

    p = sub.add_parser("envoy-config", help="print an Envoy bootstrap that uses `m3gate epp` as its endpoint picker")
    p.add_argument("path", help="pool config YAML (the replicas Envoy may be sent to)")
    p.add_argument("--epp", required=True, metavar="HOST:PORT", help="where `m3gate epp` listens (ext_proc)")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="Envoy's listener for clients")
    p.add_argument("--fail-open", action="store_true",
                   help="the picker unreachable: send requests on anyway (default: fail closed, 500)")
    p.add_argument("--admin", metavar="HOST:PORT", default=None, help="Envoy's admin interface (default: none)")
    p.add_argument("--response-processing", choices=["full", "none"], default="full",
                   help="must match `m3gate epp --response-processing`")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write the YAML here instead of stdout")
    p.set_defaults(func=_cmd_envoy_config)


def _cmd_demo(args: argparse.Namespace) -> int:
    from gateway.cli.demo import run_demo

    return run_demo(port=args.port, traffic=not args.no_traffic)


def _add_contract(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("contract", help="write the operating contract from the config; check it against Prometheus",
                       description="Per traffic class: context ceiling, warm capacity, precision and kernel path, "
                       "latency targets (traffic.classes.*.targets). With --prometheus: PASS/FAIL per class and "
                       "percentile, the dominant stage of each failure (exit 1 on a failure). With --rules: the "
                       "SLO alert rules (multi-window, multi-burn-rate) for Prometheus.")
    p.add_argument("path", help="pool config YAML")
    p.add_argument("--out", help="folder for contract.md, contract.html (with plots) and contract.json; "
                   "without it the Markdown goes to stdout")
    p.add_argument("--prometheus", metavar="URL", help="check against this Prometheus (it scrapes the gateways)")
    p.add_argument("--window", default="1h", help="PromQL range for the check (default 1h)")
    p.add_argument("--rules", metavar="FILE", help="write the SLO recording and alerting rules (YAML) here")
    p.set_defaults(func=_cmd_contract)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="replicas per pool (and prefill/decode split) the targets need at a workload",
                       description="Sizes every pool and role with the capacity model (queueing included) at a "
                       "loadtests trace's demand (or the one a Prometheus measured): replicas at its mean and at its busiest window, the bottleneck, the "
                       "predicted TTFT/TPOT p95 per class against traffic.classes.*.targets.")
    p.add_argument("path", help="pool config YAML")
    p.add_argument("--workload", metavar="FILE", help="a trace (JSONL, m3gate or Mooncake format) or a workload "
                   "YAML that replays one")
    p.add_argument("--prometheus", metavar="URL", help="instead: the demand a Prometheus measured (it scrapes the "
                   "gateways)")
    p.add_argument("--window", default="1h", help="with --prometheus: the PromQL range (default 1h)")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    p.add_argument("--peak-window-s", type=float, default=60.0, help="the peak is the busiest window this long")
    p.add_argument("--prefill-step-ms", type=float, default=20.0, help="fixed cost of a prefill step")
    p.add_argument("--prefill-ms-per-1k", type=float, default=60.0, help="prefill cost per 1K uncached tokens")
    p.add_argument("--decode-step-ms", type=float, default=20.0, help="fixed cost of a decode step")
    p.add_argument("--decode-ms-per-seq", type=float, default=0.2, help="decode step cost per sequence")
    p.add_argument("--decode-ms-per-seq-1k", type=float, default=0.02,
                   help="decode step cost per sequence per 1K tokens of context")
    p.add_argument("--costs", metavar="FILE", help="the engine costs a running gateway learnt: a saved GET "
                   "/admin/capacity answer (`curl .../admin/capacity > costs.json`); used per pool and role instead "
                   "of the --*-ms options where it has them")
    p.set_defaults(func=_cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3gate", description="Gateway in front of vLLM pools serving MiniMax-M3.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", required=True, help="pool config YAML")
    p.add_argument("--host", default=None, help="listen address (default: config server.host, env M3GATE_HOST)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: config server.port, env M3GATE_PORT)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # run as worker I of a supervisor
    p.set_defaults(func=_cmd_serve)

    _add_epp(sub)

    p = sub.add_parser("demo", help="start three simulated pools and the gateway; Ctrl-C stops all")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--no-traffic", action="store_true",
                   help="do not send the demo's own sample workload (the status page then shows your requests only)")
    p.set_defaults(func=_cmd_demo)

    cfg = sub.add_parser("config", help="validate the pool config or print its JSON schema")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("check", help="validate a config file and explain errors with their line")
    p.add_argument("path")
    p.set_defaults(func=_cmd_config_check)
    p = cfg_sub.add_parser("schema", help="print the config's JSON schema (for editors)")
    p.set_defaults(func=_cmd_config_schema)

    pools = sub.add_parser("pools", help="what the pool file says about launching the vLLM pools")
    pools_sub = pools.add_subparsers(dest="pools_command", required=True)
    p = pools_sub.add_parser("render", help="print each replica's `vllm serve` command and environment")
    p.add_argument("path", help="pool config YAML")
    p.add_argument("--pool", default=None, help="only this pool")
    p.add_argument("--format", choices=["shell", "json"], default="shell")
    p.set_defaults(func=_cmd_pools_render)

    _add_contract(sub)
    _add_plan(sub)

    try:
        _add_sim(sub)
    except ImportError:  # the simulator is optional while it is being built
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
