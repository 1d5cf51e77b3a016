"""`m3gate` console script: one entry, a subcommand per job. Subcommands import their module lazily so that
`m3gate sim` does not pay for the gateway's imports and vice versa."""

from __future__ import annotations

import argparse
import json
import sys
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
    from gateway.contract import rules_yaml, write_contract
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

    return serve(args.config, host=args.host, port=args.port)


def _cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(port=args.port, traffic=not args.no_traffic)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3gate", description="Gateway in front of vLLM pools serving MiniMax-M3.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", required=True, help="pool config YAML")
    p.add_argument("--host", default=None, help="listen address (default: config server.host, env M3GATE_HOST)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: config server.port, env M3GATE_PORT)")
    p.set_defaults(func=_cmd_serve)

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
