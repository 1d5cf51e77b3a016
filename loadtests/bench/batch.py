"""Batch jobs beside interactive traffic: the Batch API against a client loop, on simulated pools.

    python -m loadtests.bench.batch [--quick] [--phase-s 90] [--cycles 3] [--jobs 3] [--requests 1000] [--out DIR]

The peers' batch benchmark shape scaled to the simulator: interactive bursts (Poisson arrivals, a high rate for
`--phase-s`, a low one for as long, `--cycles` times; short unique streaming chats) and `--jobs` batch jobs of
`--requests` chats each, sharing 5 system prompts, on 2 simulated replicas (16 sequences each, the pool scheduling
by priority as vLLM's `--scheduling-policy priority`). Three runs on the same arrivals, the replicas' caches reset
before each:
- `none`: the interactive traffic alone;
- `loop`: the batch sent straight at the gateway by a client loop at fixed concurrency (`--loop-concurrency`), as
  users do without a Batch API (in the interactive class, as their keys would send it);
- `api`: the batch as jobs of the Batch API (/v1/files, /v1/batches), run by the gateway in its `batch` class.

Printed per run: interactive TTFT p95 and attainment (TTFT within the interactive class's 1 s target) per phase
(high, low), the batch's completion time from the run's start, and the batch requests' prefix-cache hit rate (the
replicas' `cached_tokens` ÷ prompt tokens) beside the one-replica oracle (every request after the first of its system
prompt served that prompt from cache). Goals (the issue's): interactive attainment within 1 point of `none`, the
batch done in ≤ 1.2× the loop's time, hit rate ≥ 0.9× the oracle. `--quick`: 20 s phases, one cycle, 3 × 150
requests (about 3 minutes). Results under loadtests/results/<time>-batch/ (results.json, batch.json, batch.md).

`--memory N [N ...]`: instead, one job of each size on an instant simulated replica (agent sessions off, so that the
gateway keeps no per-request table), printing lines per second and the gateway's RSS before and at its peak: the
check that a job's size does not show in the gateway's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.lib.harness import write_results
from loadtests.lib.replicas import gateway, gateway_config, rss_bytes, sim_pool, wait_gateway_sees
from loadtests.lib.results import Results

MODEL = "MiniMaxAI/MiniMax-M3"
SIM_ARGS = ["--max-num-seqs", "16", "--kv-blocks", "3000"]
TTFT_TARGET_S = 1.0
HIGH_RATE, LOW_RATE = 8.0, 2.0  # interactive requests per second in each phase
FINAL = ("completed", "failed", "expired", "cancelled")
SYSTEM_PROMPTS = [f"You are reviewer {i}. " + " ".join(f"rule-{i}-{j}: check the case carefully." for j in range(120))
                  for i in range(5)]


@dataclass
class Interactive:
    """An interactive request's outcome: when it was sent (from the run's start), its phase and TTFT."""

    at: float
    phase: str
    ttft: float | None


@dataclass
class RunResult:
    name: str
    interactive: list[Interactive] = field(default_factory=list)
    batch_done_s: float | None = None
    batch_usage: list[tuple[int, int, int]] = field(default_factory=list)  # (prompt, cached, system prompt index)


def arrivals(phase_s: float, cycles: int, seed: int = 0) -> list[tuple[float, str]]:
    """(time, phase) of every interactive request: Poisson, high then low, `cycles` times."""
    rng, out, t = random.Random(seed), [], 0.0
    for c in range(cycles):
        for phase, rate in (("high", HIGH_RATE), ("low", LOW_RATE)):
            start = c * 2 * phase_s + (phase_s if phase == "low" else 0.0)
            t = start
            while (t := t + rng.expovariate(rate)) < start + phase_s:
                out.append((t, phase))
    return out


def batch_bodies(jobs: int, requests: int) -> list[list[dict[str, Any]]]:
    return [[{"model": MODEL, "max_tokens": 128, "messages": [
        {"role": "system", "content": SYSTEM_PROMPTS[i % 5]},
        {"role": "user", "content": f"job {j} item {i}: summarise the case in one line."}]}
        for i in range(requests)] for j in range(jobs)]


async def _interactive(http: httpx.AsyncClient, url: str, at: float, phase: str, t0: float, n: int) -> Interactive:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    body = {"model": MODEL, "stream": True, "max_tokens": 32,
            "messages": [{"role": "user", "content": f"interactive question {n}: " + "context " * 400}]}
    sent, ttft = time.monotonic(), None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                if ttft is None and resp.status_code == 200:
                    ttft = time.monotonic() - sent
    except httpx.HTTPError:
        ttft = None
    return Interactive(at, phase, ttft)


async def _loop_batch(http: httpx.AsyncClient, url: str, jobs: list[list[dict[str, Any]]], concurrency: int,
                      result: RunResult, t0: float) -> None:
    """The client loop: every request straight at the gateway, `concurrency` at a time, retried on a refusal."""
    queue = [(i, body) for job in jobs for i, body in enumerate(job)]
    queue.reverse()

    async def worker() -> None:
        while queue:
            i, body = queue.pop()
            while True:
                resp = await http.post(url + "/v1/chat/completions", json=body)
                if resp.status_code not in (429, 503):
                    break
                await asyncio.sleep(1.0)
            usage = resp.json().get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            result.batch_usage.append((usage.get("prompt_tokens", 0), cached, i % 5))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.batch_done_s = time.monotonic() - t0


async def _api_batch(http: httpx.AsyncClient, url: str, jobs: list[list[dict[str, Any]]], result: RunResult,
                     t0: float) -> None:
    """The Batch API: one file and one batch per job, polled until every batch ends, outputs read back."""
    ids = []
    for job in jobs:
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + "\n" for i, body in enumerate(job))
        up = await http.post(url + "/v1/files", data={"purpose": "batch"},
                             files={"file": ("in.jsonl", io.BytesIO(lines.encode()))})
        made = await http.post(url + "/v1/batches", json={"input_file_id": up.json()["id"], "completion_window": "24h",
                                                          "endpoint": "/v1/chat/completions"})
        ids.append(made.json()["id"])
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        for batch_id in ids:
            batch = (await http.get(f"{url}/v1/batches/{batch_id}")).json()
            if batch["status"] in FINAL:
                done[batch_id] = batch
        await asyncio.sleep(0.25)
    result.batch_done_s = time.monotonic() - t0
    for batch in done.values():
        if batch.get("output_file_id"):
            text = (await http.get(f"{url}/v1/files/{batch['output_file_id']}/content")).text
            for line in text.splitlines():
                record = json.loads(line)
                usage = record["response"]["body"].get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                result.batch_usage.append((usage.get("prompt_tokens", 0), cached, int(record["custom_id"][1:]) % 5))


async def one_run(name: str, url: str, plan: list[tuple[float, str]], jobs: list[list[dict[str, Any]]],
                  concurrency: int) -> RunResult:
    result = RunResult(name)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.monotonic()
        batch = None
        if name == "loop":
            batch = asyncio.create_task(_loop_batch(http, url, jobs, concurrency, result, t0))
        elif name == "api":
            batch = asyncio.create_task(_api_batch(http, url, jobs, result, t0))
        result.interactive = list(await asyncio.gather(
            *(_interactive(http, url, at, phase, t0, n) for n, (at, phase) in enumerate(plan))))
        if batch is not None:
            await batch
    return result


def hit_rates(usage: list[tuple[int, int, int]], best: dict[int, int]) -> tuple[float, float]:
    """(observed, one-replica oracle) prefix-cache hit rate of the batch requests. The oracle serves every request
    after the first of its system prompt with `best[group]` cached tokens: the most any request of that prompt had
    cached in any run (its shared prefix, in whole blocks)."""
    prompt = sum(u[0] for u in usage) or 1
    per_group: dict[int, int] = {}
    for _, _, group in usage:
        per_group[group] = per_group.get(group, 0) + 1
    oracle = sum(best.get(g, 0) * (n - 1) for g, n in per_group.items())
    return sum(u[1] for u in usage) / prompt, oracle / prompt


def phase_rows(result: RunResult) -> dict[str, dict[str, float | None]]:
    out = {}
    for phase in ("high", "low"):
        ttfts = [r.ttft for r in result.interactive if r.phase == phase]
        ok = sorted(t for t in ttfts if t is not None)
        p95 = ok[min(len(ok) - 1, int(0.95 * len(ok)))] if ok else None
        met = sum(1 for t in ttfts if t is not None and t <= TTFT_TARGET_S)
        out[phase] = {"ttft_p95_s": p95, "attainment": met / len(ttfts) if ttfts else None}
    return out


def summarise(results: list[RunResult]) -> tuple[dict[str, Any], str]:
    best: dict[int, int] = {}
    for r in results:
        for _, cached, group in r.batch_usage:
            best[group] = max(best.get(group, 0), cached)
    rows, lines = {}, ["| run | TTFT p95 high (s) | attainment high | TTFT p95 low (s) | attainment low | batch done (s) "
                       "| batch hit rate | oracle |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        phases = phase_rows(r)
        hit, oracle = hit_rates(r.batch_usage, best) if r.batch_usage else (None, None)
        rows[r.name] = {"phases": phases, "batch_done_s": r.batch_done_s, "batch_hit_rate": hit, "oracle": oracle}
        f = (lambda v, d=2: "–" if v is None else f"{v:.{d}f}")  # noqa: E731
        lines.append(f"| {r.name} | {f(phases['high']['ttft_p95_s'])} | {f(phases['high']['attainment'], 3)} | "
                     f"{f(phases['low']['ttft_p95_s'])} | {f(phases['low']['attainment'], 3)} | {f(r.batch_done_s, 1)}"
                     f" | {f(hit, 3)} | {f(oracle, 3)} |")
    return rows, "\n".join(lines)


def results_of(rows: dict[str, Any], args: argparse.Namespace) -> Results:
    """The issue's goals (attainment with batch jobs beside it, batch time against the client loop, the batch's
    hit rate against the oracle), in the one results format."""
    results = Results("batch", vars(args), reference="no batch (attainment), a client loop (batch time), the "
                                                     "oracle (hit rate), same run")
    none, loop, api = rows["none"], rows["loop"], rows["api"]
    for phase in ("high", "low"):
        a, b = api["phases"][phase]["attainment"] or 0.0, none["phases"][phase]["attainment"] or 0.0
        results.add(f"{phase}-load SLO attainment beside the Batch API", a, "", goal="≥ without batch − 0.01",
                    passed=a >= b - 0.01, reference="without batch", reference_value=b)
    results.add("batch time / the client loop's", (api["batch_done_s"] or 0.0) / (loop["batch_done_s"] or 1.0), "×",
                at_most=1.2, reference="client loop", reference_value=loop["batch_done_s"])
    results.add("batch hit rate / the oracle's", (api["batch_hit_rate"] or 0.0) / (api["oracle"] or 1.0), "×",
                at_least=0.9, reference="oracle", reference_value=api["oracle"])
    return results


def checks(results: Results) -> list[str]:
    """The goals, each PASS or FAIL with its figures."""
    return [f"{'PASS' if f['passed'] else 'FAIL'}: {f['name']} {f['value']:.3f} (goal {f['goal']}, "
            f"{f['reference']} {f['reference_value'] if f['reference_value'] is not None else '–'})"
            for f in results.figures]


def memory_run(sizes: list[int]) -> None:
    """One job per size, one after another on one gateway: throughput and the gateway's RSS (before, peak)."""
    with sim_pool(1, extra_args=["--instant"]) as pool:
        config = gateway_config(pool.urls, extra={"sessions": {"enabled": False}})
        with gateway(config) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
            for n in sizes:
                lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                            "body": body}) + "\n" for i, body in enumerate(batch_bodies(1, n)[0]))
                before = peak = rss_bytes(gw.pid)
                up = http.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("in.jsonl", io.BytesIO(lines.encode()))}).json()
                t0 = time.monotonic()
                batch = http.post("/v1/batches", json={"input_file_id": up["id"], "completion_window": "24h",
                                                       "endpoint": "/v1/chat/completions"}).json()
                while (batch := http.get(f"/v1/batches/{batch['id']}").json())["status"] not in FINAL:
                    peak = max(peak, rss_bytes(gw.pid))
                    time.sleep(0.2)
                took = time.monotonic() - t0
                print(f"{n:,} lines ({len(lines) / 1e6:.1f} MB): {batch['status']} in {took:.1f} s, "
                      f"{n / took:.0f} lines/s; gateway RSS {before / 2**20:.0f} MiB before, "
                      f"{peak / 2**20:.0f} MiB at its peak", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--phase-s", type=float, default=90.0)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--loop-concurrency", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="results folder (default loadtests/results/<time>-batch/)")
    p.add_argument("--memory", type=int, nargs="+", metavar="N", help="measure throughput and RSS per job size")
    args = p.parse_args(argv)
    if args.memory:
        memory_run(args.memory)
        return 0
    if args.quick:
        args.phase_s, args.cycles, args.requests = 20.0, 1, 150
    plan, jobs = arrivals(args.phase_s, args.cycles), batch_bodies(args.jobs, args.requests)
    results = []
    with sim_pool(2, extra_args=SIM_ARGS) as pool:
        config = gateway_config(pool.urls, extra={"batch": {"max_in_flight": args.loop_concurrency}})
        config["pools"][0]["scheduling_policy"] = "priority"  # vLLM serves the batch class after the others
        with gateway(config) as gw:
            wait_gateway_sees(gw.url, 2)
            for name in ("none", "loop", "api"):
                pool.reset()
                results.append(asyncio.run(one_run(name, gw.url, plan, jobs, args.loop_concurrency)))
                print(f"{name}: done", flush=True)
    rows, table = summarise(results)
    results = results_of(rows, args)
    verdicts = checks(results)
    md = table + "\n\n" + "\n".join(f"- {v}" for v in verdicts)
    folder = write_results(args.out, "batch", {"args": vars(args), "runs": rows, "checks": verdicts}, md)
    results.write(folder)
    print(md)
    print(f"results: {folder}")
    return 0 if results.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
