"""Turn a run's results into the report: JSON, a Markdown table and (loadtests.lib.plots) PNGs.

Per class and overall: request and output-token throughput, TTFT / TPOT / ITL / E2EL (mean, median, std, P50, P95,
P99 via np.percentile with linear interpolation, as `vllm bench serve`), goodput against per-class SLOs (a request is
good when every SLO it has holds; TPOT counts as 0 when it produced ≤ 1 token), errors by type, the prefix-cache hit
rate the replicas reported in their usage (cached_tokens), and routing spread per replica (`x-m3gate-endpoint`).
The prefix-cache hit rate from the replicas' own /metrics (delta of vllm:prefix_cache_hits_total / queries_total
over the run) comes from `loadtests.lib.replicas.MetricsDelta` and is added by the caller.

Workloads with agent sessions also get per-session and per-turn sections (`session_report`): task time and turns per
session, the tool and think waits the generator planned and really waited, TTFT by turn index and cache path (warm:
at least half the prompt cached), and, through a gateway, what m3gate measured for the same turns (GET
/admin/sessions, matched by the session id the workload sends as `user`, hashed as the admin view shows it).
"""

from __future__ import annotations

import json
import statistics
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.lib.client import Result, RunOutput, tpot_of
from loadtests.lib.results import Results
from loadtests.lib.workload import Plan, Slo

PERCENTILES = (50, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/p50/p95/p99 in milliseconds (None when there is nothing to measure)."""
    if not len(values):
        return {"mean": None, "median": None, "std": None, **{f"p{p}": None for p in PERCENTILES}, "n": 0}
    arr = np.asarray(values, dtype=float) * 1000.0
    out: dict[str, float | None] = {"mean": float(np.mean(arr)), "median": float(np.median(arr)),
                                    "std": float(np.std(arr))}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{p}"] = float(v)
    out["n"] = int(arr.size)
    return out


def is_good(r: Result, slo: Slo) -> bool:
    if not r.ok:
        return False
    if slo.ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo.ttft_ms):
        return False
    if slo.tpot_ms is not None:
        tpot = tpot_of(r) or 0.0
        if tpot * 1000 > slo.tpot_ms:
            return False
    if slo.e2el_ms is not None and (r.e2el is None or r.e2el * 1000 > slo.e2el_ms):
        return False
    return True


def group_summary(results: Sequence[Result], duration_s: float, slo: Slo | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if r.error)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    cached_known = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2el = [r.e2el for r in ok if r.e2el is not None]
    tpot = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itl = [x for r in ok for x in r.itl]
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common()),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (prompt + output) / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "mean_prompt_tokens": prompt / len(ok) if ok else 0.0,
        "mean_output_tokens": output / len(ok) if ok else 0.0,
        "ttft_ms": stats_ms(ttft),
        "tpot_ms": stats_ms(tpot),
        "itl_ms": stats_ms(itl),
        "e2el_ms": stats_ms(e2el),
        "usage_cache_hit_rate": (sum(r.cached_tokens or 0 for r in cached_known)
                                 / sum(r.prompt_tokens or 0 for r in cached_known)) if cached_known else None,
    }
    if slo is not None and slo.as_dict():
        good = sum(1 for r in results if is_good(r, slo))
        out["slo"] = slo.as_dict()
        out["goodput"] = {"good": good, "request_goodput": good / duration_s if duration_s > 0 else 0.0,
                          "share": good / len(results) if results else 0.0}
    return out


def routing_spread(results: Iterable[Result], replicas: Sequence[str] = ()) -> dict[str, Any]:
    """Requests and tokens per replica, and the max/mean ratios (a replica listed but never used counts as 0)."""
    per: dict[str, dict[str, int]] = {r: {"requests": 0, "prompt_tokens": 0, "output_tokens": 0} for r in replicas}
    for r in results:
        if not r.replica:
            continue
        acc = per.setdefault(r.replica, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})
        acc["requests"] += 1
        acc["prompt_tokens"] += r.prompt_tokens or 0
        acc["output_tokens"] += r.output_tokens or 0
    total = sum(v["requests"] for v in per.values())
    for v in per.values():
        v["share"] = v["requests"] / total if total else 0.0  # type: ignore[assignment]

    def ratio(key: str) -> float | None:
        vals = [v[key] for v in per.values()]
        mean = sum(vals) / len(vals) if vals else 0
        return max(vals) / mean if mean else None

    return {"per_replica": per, "max_over_mean_requests": ratio("requests"),
            "max_over_mean_prompt_tokens": ratio("prompt_tokens")}


def _turn_bucket(index: int) -> str:
    """m3gate's turn-index buckets (1-based index)."""
    for hi, name in ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16")):
        if index <= hi:
            return name
    return "17+"


def _p(values: Sequence[float], q: float, scale: float = 1000.0) -> float | None:
    return round(float(np.percentile(values, q)) * scale, 2) if len(values) else None


def session_report(plan: Plan, results: Sequence[Result],
                   seen: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Per session and per turn (times in ms): what the generator did, and what m3gate measured when `seen` (GET
    /admin/sessions' open + recent sessions) is given. m3gate's view keeps a session's last 4 turns."""
    from policies.sessions import redacted

    items = {i.index: i for i in plan.items}
    by_session: dict[str, list[Result]] = {}
    for r in results:
        if r.session is not None:
            by_session.setdefault(r.session, []).append(r)
    views = {v.get("id"): v for v in seen or ()}
    task, turns, complete = [], [], 0
    planned: dict[str, list[float]] = {"tool": [], "think": []}
    waited: dict[str, list[float]] = {"tool": [], "think": []}
    m3: dict[str, list[float]] = {"tool": [], "think": []}
    diffs: dict[str, list[float]] = {"tool": [], "think": []}
    ttft: dict[str, list[float]] = {}
    found = 0
    for sid, rs in by_session.items():
        rs.sort(key=lambda r: r.turn)
        done = [r for r in rs if r.e2el is not None]
        if done:
            task.append(max(r.t_send + (r.e2el or 0.0) for r in done) - rs[0].t_send)
            turns.append(len(rs))
        if len(rs) == len([i for i in plan.items if i.session == sid]) and all(r.ok for r in rs):
            complete += 1
        view = views.get(redacted(sid)) if seen is not None else None
        found += view is not None
        m3_turns = {t["index"]: t for t in (view or {}).get("recent_turns", ())}
        for prev, r in zip(rs, rs[1:]):
            if prev.e2el is None:
                break
            kind = "tool" if items[prev.index].tool_call else "think"
            gap = r.t_send - (prev.t_send + prev.e2el)
            planned[kind].append(items[r.index].wait_s)
            waited[kind].append(gap)
            t = m3_turns.get(r.turn + 1)
            if t is not None and t.get("wait") == kind:
                m3[kind].append(t["wait_s"])
                diffs[kind].append(t["wait_s"] - gap)
        for r in rs:
            if r.ttft is None:
                continue
            cache = ("warm" if (r.cached_tokens or 0) >= 0.5 * r.prompt_tokens else "cold") if r.prompt_tokens \
                else "none"
            ttft.setdefault(f"{_turn_bucket(r.turn + 1)}/{cache}", []).append(r.ttft)

    def two(values: Sequence[float]) -> dict[str, float | None]:
        return {"p50": _p(values, 50), "p95": _p(values, 95)}

    out: dict[str, Any] = {
        "sessions": len(by_session), "complete": complete,
        "task_ms": two(task), "turns": {"p50": _p(turns, 50, 1.0), "max": max(turns, default=None)},
        "waits_ms": {k: {"planned": two(planned[k]), "waited": two(waited[k]), "n": len(waited[k])}
                     for k in ("tool", "think")},
        "ttft_ms_by_turn": {k: {"n": len(v), **two(v)} for k, v in sorted(ttft.items())},
    }
    if seen is not None:
        every = diffs["tool"] + diffs["think"]
        out["m3gate"] = {"sessions_found": found, "compared_turns": len(every),
                         "waits_ms": {k: two(m3[k]) for k in ("tool", "think")},
                         "diff_ms": {"tool_p50": _p(diffs["tool"], 50), "think_p50": _p(diffs["think"], 50),
                                     "p50": _p(every, 50), "p99": _p(every, 99)}}
    return out


def build_report(plan: Plan, run: RunOutput, *, replicas: Sequence[str] = (), cache: Mapping[str, Any] | None = None,
                 oracle: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                 sessions_seen: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    results = run.results
    by_class: dict[str, list[Result]] = {}
    for r in results:
        by_class.setdefault(r.cls, []).append(r)
    classes = {c: group_summary(rs, run.duration_s, plan.slos.get(c)) for c, rs in by_class.items()}
    overall_slo = None
    overall = group_summary(results, run.duration_s, overall_slo)
    goods = [c["goodput"]["good"] for c in classes.values() if "goodput" in c]
    if goods:
        good = sum(goods)
        overall["goodput"] = {"good": good, "request_goodput": good / run.duration_s if run.duration_s else 0.0,
                              "share": good / len(results) if results else 0.0,
                              "note": "classes without SLOs count as not good" if len(goods) < len(classes) else ""}
    report: dict[str, Any] = {
        "workload": plan.name,
        "source": plan.source,
        "target": run.target,
        "started": run.started_wall,
        "duration_s": run.duration_s,
        "planned": run.planned,
        "sent": len(results),
        "not_sent": run.not_sent,
        "overall": overall,
        "classes": classes,
        "routing": routing_spread(results, replicas),
    }
    if any(r.session is not None for r in results):
        report["sessions"] = session_report(plan, results, sessions_seen)
    if cache is not None:
        report["prefix_cache"] = dict(cache)
    if oracle is not None:
        report["oracle"] = dict(oracle)
    if extra:
        report.update(extra)
    return report


# ---------------------------------------------------------------------------------------------------------------
# Markdown


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(v: Any) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def markdown(report: Mapping[str, Any]) -> str:
    lines = [f"# Load test: {report['workload']}", "",
             f"Target: {report['target']}. Duration {report['duration_s']:.1f} s; {report['sent']} sent of "
             f"{report['planned']} planned ({report['not_sent']} not sent before the end).", ""]
    head = ("| class | reqs | ok | err | req/s | out tok/s | TTFT p50/p95/p99 ms | TPOT p50/p95/p99 ms "
            "| ITL p50/p95/p99 ms | E2E p50/p95/p99 ms | goodput (share) | cache hit (usage) |")
    lines += [head, "|" + "|".join(["---"] * 12) + "|"]

    def row(name: str, g: Mapping[str, Any]) -> str:
        def tri(m: str) -> str:
            s = g[m]
            return "/".join(_f(s[f"p{p}"]) for p in PERCENTILES)

        gp = g.get("goodput")
        good = f"{gp['request_goodput']:.2f}/s ({_pct(gp['share'])})" if gp else "–"
        return (f"| {name} | {g['requests']} | {g['completed']} | {g['failed']} | {g['request_throughput']:.2f} | "
                f"{g['output_throughput']:.0f} | {tri('ttft_ms')} | {tri('tpot_ms')} | {tri('itl_ms')} | "
                f"{tri('e2el_ms')} | {good} | {_pct(g['usage_cache_hit_rate'])} |")

    for name, g in report["classes"].items():
        lines.append(row(name, g))
    lines.append(row("**overall**", report["overall"]))
    lines.append("")
    errors = report["overall"]["errors"]
    lines.append("Errors by type: " + (", ".join(f"{k} ×{v}" for k, v in errors.items()) if errors else "none"))
    slos = {c: g["slo"] for c, g in report["classes"].items() if "slo" in g}
    if slos:
        lines.append("SLOs: " + "; ".join(f"{c}: " + ", ".join(f"{k} ≤ {v:g}" for k, v in s.items())
                                           for c, s in slos.items()))
    cache = report.get("prefix_cache")
    if cache:
        lines.append(f"Prefix-cache hit rate from the replicas' /metrics: {_pct(cache.get('rate'))} "
                     f"({cache.get('hits', 0):.0f} of {cache.get('queries', 0):.0f} prompt tokens)")
    oracle = report.get("oracle")
    if oracle:
        lines.append(f"Oracle hit rate (session per replica, infinite cache): {_pct(oracle.get('session'))}; "
                     f"global (one infinite cache): {_pct(oracle.get('global'))}")
    lines += ["", "| replica | requests | share | prompt tokens | output tokens | metrics hit rate |",
              "|---|---|---|---|---|---|"]
    per_cache = (cache or {}).get("per_replica", {})
    for url, v in report["routing"]["per_replica"].items():
        lines.append(f"| {url} | {v['requests']} | {_pct(v['share'])} | {v['prompt_tokens']} | {v['output_tokens']} | "
                     f"{_pct((per_cache.get(url) or {}).get('rate'))} |")
    lines.append(f"\nMax/mean replica load: {_f(report['routing']['max_over_mean_requests'], 2)} (requests), "
                 f"{_f(report['routing']['max_over_mean_prompt_tokens'], 2)} (prompt tokens)")
    if report.get("sessions"):
        lines += session_markdown(report["sessions"])
    return "\n".join(lines) + "\n"


def session_markdown(s: Mapping[str, Any]) -> list[str]:
    def two(v: Mapping[str, Any]) -> str:
        return f"{_f(v.get('p50'))} / {_f(v.get('p95'))}"

    m3 = s.get("m3gate")
    lines = ["", "## Sessions", "",
             f"{s['sessions']} sessions ({s['complete']} ran every planned turn); task time (first send → last "
             f"byte) p50 / p95 {two(s['task_ms'])} ms; turns p50 {_f(s['turns']['p50'], 0)}, max "
             f"{_f(s['turns']['max'])}.", "",
             "| wait | turns | planned p50 / p95 ms | generator waited p50 / p95 ms | m3gate measured p50 / p95 ms |",
             "|---|---|---|---|---|"]
    for kind, name in (("tool", "tool turnaround"), ("think", "think time")):
        w = s["waits_ms"][kind]
        lines.append(f"| {name} | {w['n']} | {two(w['planned'])} | {two(w['waited'])} | "
                     f"{two(m3['waits_ms'][kind]) if m3 else '–'} |")
    if m3:
        d = m3["diff_ms"]
        lines.append(f"\nm3gate (GET /admin/sessions): {m3['sessions_found']} of {s['sessions']} sessions found by "
                     f"id; per-turn difference m3gate − generator over {m3['compared_turns']} turns (its last 4 per "
                     f"session): p50 {_f(d['p50'], 2)} ms, p99 {_f(d['p99'], 2)} ms (tool {_f(d['tool_p50'], 2)}, "
                     f"think {_f(d['think_p50'], 2)}).")
    lines += ["", "## Turns: TTFT by turn index and cache path", "", "| turn / cache | n | TTFT p50 / p95 ms |",
              "|---|---|---|"]
    for key, v in s["ttft_ms_by_turn"].items():
        lines.append(f"| {key} | {v['n']} | {two(v)} |")
    return lines


def write_report(report: Mapping[str, Any], run: RunOutput, out_dir: Path, plan: Plan, *, plots: bool = True,
                 trace: bool = True) -> list[Path]:
    """report.json, report.md, results.json (its headline figures, loadtests/lib/results.py), results.jsonl (one
    line per request), trace.jsonl (replayable) and PNG plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [report_results(report).write(out_dir)]
    p = out_dir / "report.json"
    p.write_text(json.dumps(report, indent=2, default=str))
    written.append(p)
    p = out_dir / "report.md"
    p.write_text(markdown(report))
    written.append(p)
    p = out_dir / "results.jsonl"
    with p.open("w") as f:
        for r in run.results:
            f.write(json.dumps(r.as_dict()) + "\n")
    written.append(p)
    if trace:
        from loadtests.lib.oracle import trace_records

        by_index = {i.index: i for i in plan.items}
        sent = {r.index: r.t_send for r in run.results}
        items = [by_index[r.index] for r in sorted(run.results, key=lambda r: r.t_send)]
        p = out_dir / "trace.jsonl"
        with p.open("w") as f:
            for rec in trace_records(items, sent):
                f.write(json.dumps(rec) + "\n")
        written.append(p)
    if plots:
        from loadtests.lib.plots import write_plots

        written += write_plots(run, report, out_dir)
    return written


def report_results(report: Mapping[str, Any]) -> Results:
    """A run's headline figures in the one results format: requests completed of those sent, TTFT and end-to-end
    latency, throughput, and the replicas' prefix-cache hit rate beside the oracle's (no goals: a load test run
    reports; `--contract` judges)."""
    o = report["overall"]
    results = Results(f"run {report['workload']}", {"workload": report["workload"], "target": report["target"],
                                                    "planned": report["planned"]},
                      reference="the oracle's hit rate (each session on one replica, an infinite cache)")
    results.add("requests completed", o["completed"], "requests", reference="sent", reference_value=o["requests"])
    results.add("TTFT p50", o["ttft_ms"]["p50"], "ms")
    results.add("TTFT p95", o["ttft_ms"]["p95"], "ms")
    results.add("end-to-end latency p95", o["e2el_ms"]["p95"], "ms")
    results.add("request throughput", o["request_throughput"], "req/s")
    rate = (report.get("prefix_cache") or {}).get("rate")
    oracle = (report.get("oracle") or {}).get("session")
    results.add("prefix-cache hit rate (replicas' /metrics)", None if rate is None else 100 * rate, "%",
                reference="oracle", reference_value=None if oracle is None else 100 * oracle)
    return results


def median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one configuration as one row: each numeric field's median (ints stay ints), the rest from the last
    round."""
    out = dict(rows[-1])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [r[key] for r in rows if r.get(key) is not None]
            median = statistics.median(vals) if vals else None
            out[key] = round(median) if isinstance(value, int) and median is not None else median
    return out


def routing_reasons(gateway_url: str) -> dict[str, float]:
    """m3gate_routing_decisions_total by reason from a gateway's /metrics (best effort: {} when unreachable)."""
    try:
        with urllib.request.urlopen(gateway_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("m3gate_routing_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else "?"
            out[reason] = out.get(reason, 0.0) + float(value)
    return out
