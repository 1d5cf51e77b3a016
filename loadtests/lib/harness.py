"""One run end to end: plan → client → replicas' metrics delta → oracle → report files. Used by the CLI, the
benchmarks and the self-test."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.lib.client import RunOutput, Target, run_plan
from loadtests.lib.replicas import MetricsDelta
from loadtests.lib.report import build_report, markdown, write_report
from loadtests.lib.workload import Plan

RESULTS_DIR = Path(__file__).parents[1] / "results"


def run_dir(name: str, root: Path | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    return (root or RESULTS_DIR) / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}"


def write_results(out: Path | None, name: str, data: Mapping[str, Any], md: str) -> Path:
    """A suite's results as NAME.json (with the command that produced them) and NAME.md, in `out` or a fresh
    run folder; returns the folder (printed by the caller)."""
    folder = out or run_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"command": " ".join(sys.argv), **data}, indent=2, default=str))
    (folder / f"{name}.md").write_text(md + "\n")
    return folder


def gateway_replicas(gateway_url: str, admin_key: str | None = None) -> list[str]:
    """The replica URLs a gateway routes to (its /admin/pools; loopback needs no key)."""
    req = urllib.request.Request(gateway_url.rstrip("/") + "/admin/pools")
    if admin_key:
        req.add_header("authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            pools = json.loads(resp.read())["pools"]
    except (OSError, KeyError, ValueError):
        return []
    return [url for pool in pools.values() for url in pool.get("replicas", {})]


def gateway_sessions(gateway_url: str, admin_key: str | None = None) -> list[dict[str, Any]] | None:
    """A gateway's open and recently ended sessions (GET /admin/sessions?limit=1000); None when it has none to show."""
    req = urllib.request.Request(gateway_url.rstrip("/") + "/admin/sessions?limit=1000")
    if admin_key:
        req.add_header("authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            body = json.loads(resp.read())
        return list(body["open"]) + list(body["recent"])
    except (OSError, KeyError, ValueError):
        return None


def execute(plan: Plan, target: Target, *, replicas: Sequence[str] = (), out_dir: Path | None = None,
            oracle: bool = True, plots: bool = True, progress: bool | None = None, quiet: bool = False,
            extra: Mapping[str, Any] | None = None, **run_kwargs: Any) -> tuple[dict[str, Any], RunOutput]:
    """Run `plan` against `target`; returns (report, raw run). Writes files when `out_dir` is given."""
    delta = MetricsDelta(replicas) if replicas else None
    run = asyncio.run(run_plan(plan, target, progress=progress, **run_kwargs))
    cache = delta.result() if delta else None
    oracle_rates = None
    if oracle:
        from loadtests.lib.oracle import oracle_hit_rates

        oracle_rates = oracle_hit_rates(plan, sent=[r.index for r in run.results])
    seen = gateway_sessions(target.gateway) if target.gateway and plan.sessions() else None
    report = build_report(plan, run, replicas=replicas, cache=cache, oracle=oracle_rates, extra=extra,
                          sessions_seen=seen)
    if out_dir is not None:
        write_report(report, run, out_dir, plan, plots=plots)
        report["files"] = str(out_dir)
    if not quiet:
        print(markdown(report))
        if out_dir is not None:
            print(f"results: {out_dir}")
    return report, run
