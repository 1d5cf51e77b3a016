"""`m3gate plan pools.yaml --workload FILE | --prometheus URL --window 1h`: the replicas each pool (and each side of a disaggregated one) needs for
the contract's targets at a recorded demand, with the predicted percentiles, from policies/capacity.py's model.

The workload is a loadtests trace (loadtests/lib/workload.py): JSONL in m3gate's format (`timestamp`, `prompt_tokens`,
`output_tokens`, `prefix_group`, `prefix_tokens`, `class`; a run's results/<run>/requests.jsonl is one) or
Mooncake's (`timestamp` in ms, `input_length`, `output_length`, `hash_ids` of 512-token blocks), or a workload YAML
whose `trace.path` names one. Each request goes to the smallest pool that holds prompt + output (the pool choice
without spill); its class is the trace's `class` where the config defines it, else its pool's. A prefix is taken as
cached from its second use on (prefix-affinity routing keeps it on the replica that has it).

With `--prometheus`, the demand is what a Prometheus that scrapes the gateways measured over the window, per pool and
class (pools/prometheus.py `observe_demand`): the arrival rate (mean, and the busiest minute), the mean prompt,
cached and output tokens.

The demand is sized twice: at the mean rate and at the busiest `window_s` (the count a fixed pool would
need; an autoscaled pool moves between the two). Engine costs are the model's defaults unless given (GET
/admin/capacity shows the ones a running gateway has learnt).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from policies.capacity import ClassDemand, EngineCosts, Prediction, predict, size
from policies.config import GatewayConfig
from policies.traffic import pool_class

MOONCAKE_BLOCK = 512


class PlanError(ValueError):
    """A workload file that cannot be planned from; the message says why."""


@dataclass(slots=True)
class TraceRequest:
    at: float  # seconds from the trace's start
    prompt: int
    cached: int
    output: int
    cls: str | None


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a JSONL trace (m3gate or Mooncake format), or of the trace a workload YAML replays."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc.strerror or exc}") from None
    if path.suffix in (".yaml", ".yml"):
        spec = yaml.safe_load(text) or {}
        trace = spec.get("trace") if isinstance(spec, dict) else None
        target = trace.get("path") if isinstance(trace, dict) else trace
        if not isinstance(target, str):
            raise PlanError(f"{path}: only workloads that replay a trace (`trace: {{path: ...}}`) can be planned; "
                            "pass the trace's JSONL")
        return read_trace(path.parent / target)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}, line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise PlanError(f"{path}, line {n}: expected an object")
        rows.append(row)
    if not rows:
        raise PlanError(f"{path}: no requests")
    mooncake = "input_length" in rows[0]
    seen_groups: set[str] = set()
    seen_blocks: set[Any] = set()
    out = []
    for n, row in enumerate(rows, 1):
        try:
            if mooncake:
                at, prompt, output = float(row["timestamp"]) / 1000.0, int(row["input_length"]), int(row["output_length"])
                cached = 0
                for block in row.get("hash_ids") or ():
                    if block not in seen_blocks:
                        break
                    cached += MOONCAKE_BLOCK
                seen_blocks.update(row.get("hash_ids") or ())
            else:
                at, prompt = float(row["timestamp"]), int(row["prompt_tokens"])
                output = int(row.get("output_tokens") or 0)
                group = row.get("prefix_group")
                cached = int(row.get("prefix_tokens") or 0) if group is not None and group in seen_groups else 0
                if group is not None:
                    seen_groups.add(group)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{path}, request {n}: missing or bad field ({exc})") from None
        cls = row.get("class")
        out.append(TraceRequest(at, prompt, min(cached, prompt), output, cls if isinstance(cls, str) else None))
    start = min(r.at for r in out)
    for r in out:
        r.at -= start
    return sorted(out, key=lambda r: r.at)


@dataclass
class _Mix:
    count: int = 0
    prompt: float = 0.0
    cached: float = 0.0
    output: float = 0.0
    times: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ClassLoad:
    """One class's demand on one pool: mean prompt / cached / output tokens, mean and peak arrival rate."""

    prompt: float
    cached: float
    output: float
    rate_mean: float
    rate_peak: float


def trace_loads(config: GatewayConfig, requests: list[TraceRequest],
                window_s: float = 60.0) -> tuple[dict[str, dict[str, ClassLoad]], dict[str, Any]]:
    """pool → class → its load in a trace (the peak: the pool's busiest `window_s`), and what the trace was."""
    by_size = config.pools_by_size()
    mixes: dict[str, dict[str, _Mix]] = defaultdict(dict)
    unplaced = 0
    for r in requests:
        pool = next((p for p in by_size if r.prompt + r.output <= p.max_model_len), None)
        if pool is None:
            unplaced += 1
            continue
        cls = r.cls if r.cls in config.traffic.classes else pool_class(config.traffic, by_size, pool.name)
        mix = mixes[pool.name].setdefault(cls, _Mix())
        mix.count += 1
        mix.prompt += r.prompt
        mix.cached += r.cached
        mix.output += r.output
        mix.times.append(r.at)
    duration = max(1.0, max((r.at for r in requests), default=0.0))
    window = min(window_s, duration)
    loads: dict[str, dict[str, ClassLoad]] = {}
    for name, classes in mixes.items():
        peak_start = _busiest(sorted(t for m in classes.values() for t in m.times), window)
        loads[name] = {}
        for cls, m in classes.items():
            mean = m.count / duration
            in_peak = sum(peak_start <= t <= peak_start + window for t in m.times) / window
            loads[name][cls] = ClassLoad(m.prompt / m.count, m.cached / m.count, m.output / m.count, mean,
                                         max(mean, in_peak))  # never below the mean (a trace shorter than the window)
    source = {"requests": len(requests), "unplaced": unplaced, "duration_s": round(duration, 3),
              "peak_window_s": window}
    return loads, source


def learnt_costs(view: Any) -> dict[tuple[str, str], EngineCosts]:
    """(pool, role) → the engine costs a running gateway learnt, from a saved `GET /admin/capacity` answer."""
    if not isinstance(view, dict) or not isinstance(view.get("pools"), dict):
        raise PlanError("--costs: not a saved GET /admin/capacity answer (no \"pools\" object)")
    out: dict[tuple[str, str], EngineCosts] = {}
    for pool, roles in view["pools"].items():
        for role, entry in (roles.items() if isinstance(roles, dict) else ()):
            costs = entry.get("costs") if isinstance(entry, dict) else None
            if not isinstance(costs, dict):
                continue
            try:
                out[(pool, role)] = EngineCosts(**{k: costs[k] for k in EngineCosts.__slots__ if k in costs})
            except TypeError as exc:
                raise PlanError(f"--costs: pool {pool!r} role {role!r}: {exc}") from exc
    if not out:
        raise PlanError("--costs: no pool in it carries learnt costs (was the gateway's first window over?)")
    return out


def plan(config: GatewayConfig, loads: dict[str, dict[str, ClassLoad]], costs: EngineCosts | None = None,
         source: dict[str, Any] | None = None,
         learnt: dict[tuple[str, str], EngineCosts] | None = None) -> dict[str, Any]:
    """Per pool and role: the replicas at the mean and at the peak demand, the bottleneck, the predictions.
    `learnt`: per (pool, role), the costs a gateway learnt (`--costs`), used instead of `costs` where present."""
    base = costs or EngineCosts()
    pools: dict[str, Any] = {}
    for pool in config.pools_by_size():
        classes = sorted(loads.get(pool.name, {}).items())
        mean = [_demand(config, name, load, load.rate_mean) for name, load in classes]
        peak = [_demand(config, name, load, load.rate_peak) for name, load in classes]
        kv = pool.kv_blocks * pool.block_size if pool.kv_blocks else None
        roles = ("prefill", "decode") if pool.disaggregation is not None else ("both",)
        bounds = pool.capacity
        pools[pool.name] = {}
        for role in roles:
            known = (learnt or {}).get((pool.name, role))
            chosen = known or base
            pool_costs = EngineCosts(chosen.prefill_step_s, chosen.prefill_s_per_1k, chosen.decode_step_s,
                                     chosen.decode_s_per_seq, chosen.decode_s_per_seq_1k,
                                     (known.kv_tokens if known is not None else None) or kv)
            at_mean, at_peak = size(role, mean, pool_costs), size(role, peak, pool_costs)
            n_mean = _bounded(at_mean.replicas, bounds.min_replicas, bounds.max_replicas)
            n_peak = _bounded(at_peak.replicas, bounds.min_replicas, bounds.max_replicas)
            pools[pool.name][role] = {
                "replicas_mean": n_mean, "replicas_peak": n_peak,
                "costs_source": "learnt" if known is not None else "given",
                "bottleneck": at_peak.bottleneck,
                "capped": at_peak.replicas > n_peak,  # max_replicas is below what the peak needs
                "predicted_mean": _view(predict(role, mean, pool_costs, n_mean)),
                "predicted_peak": _view(predict(role, peak, pool_costs, n_peak)),
                "demand": {d.name: {"rate_mean_per_s": round(d.rate, 4), "rate_peak_per_s": round(p.rate, 4),
                                    "prompt_tokens": round(d.prompt_tokens, 1),
                                    "uncached_tokens": round(d.uncached_tokens, 1),
                                    "output_tokens": round(d.output_tokens, 1),
                                    "ttft_p95_target_s": d.ttft_p95_s, "tpot_p95_target_s": d.tpot_p95_s}
                           for d, p in zip(mean, peak)},
            }
    return {**(source or {}), "costs": {k: getattr(base, k) for k in EngineCosts.__slots__ if k != "kv_tokens"},
            "pools": pools}


def _busiest(times: list[float], window: float) -> float:
    """The start of the `window` holding the most of the sorted `times`."""
    best, start, j = 0, 0.0, 0
    for i, t in enumerate(times):
        while times[j] < t - window + 1e-9:
            j += 1
        if i - j + 1 > best:
            best, start = i - j + 1, max(0.0, t - window + 1e-9)
    return start


def _demand(config: GatewayConfig, name: str, load: ClassLoad, rate: float) -> ClassDemand:
    targets = config.traffic.classes[name].latency_targets() if name in config.traffic.classes else {}
    ttft = dict(targets.get("ttft", ())).get("p95")
    tpot = dict(targets.get("tpot", ())).get("p95")
    return ClassDemand(name, rate, load.prompt, max(0.0, load.prompt - load.cached), load.output,
                       None if ttft is None else ttft / 1000.0, None if tpot is None else tpot / 1000.0)


def _bounded(n: int, low: int, high: int | None) -> int:
    return max(low, n if high is None else min(high, n))


def _seconds(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def _view(p: Prediction) -> dict[str, Any]:
    return {"replicas": p.replicas, "utilisation": _seconds(p.utilisation),
            "kv_usage": None if p.kv_usage is None else _seconds(p.kv_usage), "meets_targets": p.ok(),
            "classes": {n: {"ttft_p95_s": _seconds(c.ttft_p95_s), "tpot_p95_s": _seconds(c.tpot_p95_s)}
                        for n, c in p.classes.items()}}


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def to_markdown(result: dict[str, Any], source: str) -> str:
    """The plan as a Markdown report: one row per pool role, then one per class with predicted p95s vs targets."""
    if "requests" in result:
        what = (f"{result['requests']} requests over {result['duration_s']:.0f} s"
                + (f" ({result['unplaced']} fit no pool)" if result["unplaced"] else "")
                + f"; peak = the busiest {result['peak_window_s']:.0f} s.")
    else:
        what = f"The last {result['window']} as Prometheus measured it; peak = the busiest {result['peak_step']}."
    lines = [f"# Capacity plan: {source}", "", what, "",
             "| pool | role | replicas at mean | replicas at peak | bottleneck at peak |",
             "|---|---|---|---|---|"]
    for pool, roles in result["pools"].items():
        for role, r in roles.items():
            capped = " (capped by max_replicas)" if r["capped"] else ""
            lines.append(f"| {pool} | {role} | {r['replicas_mean']} | {r['replicas_peak']}{capped} | "
                         f"{r['bottleneck'] or '—'} |")
    lines += ["", "| pool | role | class | rate mean / peak (/s) | TTFT p95 at peak (ms) | target | "
              "TPOT p95 at peak (ms) | target |", "|---|---|---|---|---|---|---|---|"]
    for pool, roles in result["pools"].items():
        for role, r in roles.items():
            for cls, d in r["demand"].items():
                p = r["predicted_peak"]["classes"].get(cls, {})
                lines.append(f"| {pool} | {role} | {cls} | {d['rate_mean_per_s']:.2f} / {d['rate_peak_per_s']:.2f} | "
                             f"{_ms(p.get('ttft_p95_s'))} | {_ms(d['ttft_p95_target_s'])} | "
                             f"{_ms(p.get('tpot_p95_s'))} | {_ms(d['tpot_p95_target_s'])} |")
    c = result["costs"]
    lines += ["", f"Engine costs: prefill {c['prefill_step_s'] * 1000:.1f} ms a step + "
              f"{c['prefill_s_per_1k'] * 1000:.1f} ms per 1K uncached tokens; decode {c['decode_step_s'] * 1000:.1f} "
              f"ms a step + {c['decode_s_per_seq'] * 1000:.3f} ms per sequence + "
              f"{c['decode_s_per_seq_1k'] * 1000:.4f} ms per sequence per 1K context."]
    return "\n".join(lines) + "\n"
