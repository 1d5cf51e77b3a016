"""Does a burst of long repository jobs take first-token latency away from interactive users?

`python -m loadtests.bench.isolation` starts two simulated pools with vLLM-like timing (60 µs of prefill per prompt
token, 12 ms per decode step) and a gateway in front of them, then measures interactive time to first token (TTFT,
client side, streamed chats of ~1,500 prompt tokens arriving at a steady rate):

1. baseline: interactive traffic alone;
2. burst: the same interactive traffic while a burst of long requests (~15K-token prompts, long answers, sent by a
   process of their own as real clients would be) arrives within about a second and saturates the repository pool
   (its class admits `--repo-concurrency` at a time; the rest wait in the gateway's queue).

It prints p50/p95 of both and the ratio burst p95 / baseline p95; the target is at most 1.20 (results.json in
`--out`, loadtests/lib/results.py; `--quick`: 8 s phases).
`--no-admission` runs the burst with the repository class limit lifted, for comparison.
tests/integration/test_traffic_control_isolation.py runs a shorter version and asserts the target.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import random
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.launcher import start_gateway
from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
TARGET_RATIO = 1.20
INTERACTIVE_CHARS = 6_000  # ~1,500 simulated tokens (4 bytes each)
LONG_CHARS = 60_000  # ~15,000: only the repository pool holds it


@dataclass
class IsolationResult:
    baseline: list[float]
    burst: list[float]
    burst_sent: int
    burst_upstream: int  # requests the repository pool held (running + waiting in vLLM) at the end of the burst

    @staticmethod
    def pct(samples: list[float], q: float) -> float:
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    @property
    def ratio(self) -> float:
        return self.pct(self.burst, 0.95) / self.pct(self.baseline, 0.95)

    def report(self) -> str:
        lines = [f"{'phase':<10}{'n':>6}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}"]
        for name, samples in (("baseline", self.baseline), ("burst", self.burst)):
            lines.append(f"{name:<10}{len(samples):>6}{self.pct(samples, 0.5) * 1000:>10.1f}"
                         f"{self.pct(samples, 0.95) * 1000:>10.1f}{max(samples) * 1000:>10.1f}")
        lines.append(f"long requests in the burst: {self.burst_sent}; at its end {self.burst_upstream} were in the "
                     f"repository pool, {self.burst_sent - self.burst_upstream} waited in the gateway's queue")
        verdict = "OK" if self.ratio <= TARGET_RATIO else "OVER TARGET"
        lines.append(f"interactive TTFT p95 ratio burst/baseline: {self.ratio:.3f} (target <= {TARGET_RATIO}) "
                     f"{verdict}")
        return "\n".join(lines)


def _words(rng: random.Random, vocab: list[str], chars: int) -> str:
    out, size = [], 0
    while size < chars:
        word = rng.choice(vocab)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def gateway_config(interactive_url: str, repository_url: str, repo_concurrency: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [
            {"name": "interactive", "max_model_len": 16384, "endpoints": [interactive_url]},
            {"name": "repository", "max_model_len": 65536, "endpoints": [repository_url]},
        ],
        "server": {"health_interval_s": 0.5},
        "traffic": {"classes": {
            "interactive": {"priority": 0, "max_concurrency": 64, "queue_length": 256, "max_queue_wait_s": 10},
            "repository": {"priority": 1, "max_concurrency": repo_concurrency, "queue_length": 256,
                           "max_queue_wait_s": 300, "spill_upward": False},
        }},
    }


async def _ttft(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds to the first streamed bytes (the first token's event: vLLM and the simulator send nothing before)."""
    started = time.perf_counter()
    async with client.stream("POST", "/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"interactive request failed: {resp.status_code} {await resp.aread()!r}")
        chunks = resp.aiter_raw()
        async for _ in chunks:
            ttft = time.perf_counter() - started
            break
        async for _ in chunks:
            pass
    return ttft


def _bodies(rng: random.Random, n: int, chars: int, max_tokens: int) -> list[dict[str, Any]]:
    """Unique prompts (no prefix-cache hits), made before measuring so the client's own work does not count."""
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(4000)]
    return [{"model": MODEL, "stream": True, "max_tokens": max_tokens,
             "messages": [{"role": "user", "content": _words(rng, vocab, chars)}]} for _ in range(n)]


async def _interactive(client: httpx.AsyncClient, rate: float, bodies: list[dict[str, Any]]) -> list[float]:
    """Open-loop arrivals at `rate` per second: a slow answer never slows the arrivals."""
    tasks = []
    start = time.perf_counter()
    for n, body in enumerate(bodies, 1):
        tasks.append(asyncio.create_task(_ttft(client, body)))
        await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
    return list(await asyncio.gather(*tasks))


async def _long_job(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    async with client.stream("POST", "/chat/completions", json=body) as resp:
        async for _ in resp.aiter_raw():
            pass


def _burst_client(base_url: str, bodies: list[dict[str, Any]], ready: Any, go: Any, stop: Any) -> None:
    """The burst's clients, in a process of their own (as real ones would be): their sending and reading must not
    delay the interactive client's clock. They arrive within about a second and hang up when told to: queued
    requests then leave the gateway's queue and running ones are aborted upstream."""

    async def main() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=httpx.Limits(max_connections=1000)) as c:
            ready.set()
            await asyncio.to_thread(go.wait)
            jobs = []
            for body in bodies:
                jobs.append(asyncio.create_task(_long_job(c, body)))
                await asyncio.sleep(1.0 / len(bodies))
            await asyncio.to_thread(stop.wait)
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)

    asyncio.run(main())


async def measure(base_url: str, *, rate: float, seconds: float, burst: int, upstream_load: Any,
                  seed: int = 0) -> IsolationResult:
    """`upstream_load()` says how many requests the repository pool holds (running + waiting in vLLM)."""
    rng = random.Random(seed)
    per_phase = max(1, round(rate * seconds))
    warmup, baseline_bodies, burst_phase = (_bodies(rng, n, INTERACTIVE_CHARS, 16) for n in (
        max(1, round(rate)), per_phase, per_phase))
    ctx = multiprocessing.get_context("spawn")
    ready, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    burster = ctx.Process(target=_burst_client, daemon=True,
                          args=(base_url, _bodies(rng, burst, LONG_CHARS, 1024), ready, go, stop))
    burster.start()
    try:
        await asyncio.to_thread(ready.wait, 60)  # its start-up (imports) must not overlap the baseline
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            await _interactive(client, rate, warmup)  # connections, caches, latency estimates
            baseline = await _interactive(client, rate, baseline_bodies)
            go.set()
            during = await _interactive(client, rate, burst_phase)
            upstream = await asyncio.to_thread(upstream_load)
    finally:
        stop.set()
        burster.join(30)
        if burster.is_alive():
            burster.kill()
    return IsolationResult(baseline, during, burst, upstream)


def run(*, rate: float = 8.0, seconds: float = 10.0, burst: int = 32, repo_concurrency: int = 4,
        speed: float = 1.0) -> IsolationResult:
    """Start the pools and a gateway, measure, stop everything."""
    sim_args = ["--speed", str(speed), "--mean-output-tokens", "0"]
    specs = [{"max_model_len": 16384, "extra_args": sim_args},
             {"max_model_len": 65536, "extra_args": [*sim_args, "--kv-blocks", "8192"]}]
    with running_sims(specs) as (interactive, repository):
        gw = start_gateway(gateway_config(interactive.url, repository.url, repo_concurrency))

        def upstream_load() -> int:
            stats = repository.stats()
            return int(stats["running"] + stats["waiting"])

        try:
            return asyncio.run(measure(gw.base_url, rate=rate, seconds=seconds, burst=burst,
                                       upstream_load=upstream_load))
        finally:
            gw.stop()


def results_of(result: IsolationResult, args: argparse.Namespace) -> Results:
    """Interactive TTFT during the burst beside the baseline's, and the ratio's target, in the one results format."""
    out = Results("isolation", vars(args), reference="interactive TTFT without the burst, same run")
    out.add("interactive TTFT p95 during the burst", result.pct(result.burst, 0.95) * 1000, "ms",
            reference="baseline", reference_value=result.pct(result.baseline, 0.95) * 1000)
    out.add("interactive TTFT p95, burst / baseline", result.ratio, "×", at_most=TARGET_RATIO)
    out.add("long requests of the burst held in the gateway's queue", result.burst_sent - result.burst_upstream,
            "requests", reference="sent", reference_value=result.burst_sent)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=8.0, help="interactive requests per second")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument("--burst", type=int, default=32, help="long requests in the burst")
    parser.add_argument("--repo-concurrency", type=int, default=4, help="repository class max_concurrency")
    parser.add_argument("--no-admission", action="store_true", help="lift the repository class limit")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated replicas' speed (0.5: twice as slow)")
    parser.add_argument("--quick", action="store_true", help="8 s phases")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-isolation)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 8.0
    result = run(rate=args.rate, seconds=args.seconds, burst=args.burst, speed=args.speed,
                 repo_concurrency=100_000 if args.no_admission else args.repo_concurrency)
    print(result.report())
    folder = args.out or run_dir("isolation")
    results_of(result, args).write(folder)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
