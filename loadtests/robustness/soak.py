"""Soak: a mixed workload for a long while through two gateways sharing a Redis, with replica restarts and config
reloads along the way; afterwards nothing may have grown that should not.

    python -m loadtests.robustness.soak                     30 minutes (`make soak`)
    python -m loadtests.robustness.soak --minutes 2         the CI version (tests/soak runs it under pytest)

Three simulated replicas (small KV caches, so the prefix index reaches its bound early), two `m3gate serve`
processes with `state:` on a private `redis-server`, all on 127.0.0.1. The load mixes chat (streamed and not),
completions, responses and messages requests over many sessions with shared prefixes, clients that hang up
mid-stream, and requests the gateway refuses. Every `restart_every_s` one replica is SIGKILLed and restarted on its
port; every `reload_every_s` both gateways reload a config without one replica, then with it again.

Sampled every few seconds, per gateway: RSS and open file descriptors (/proc/PID), in-flight counts and prefix
index sizes (GET /admin/pools). Checked at the end:

- RSS growth from the end of warm-up to the end < 5 % (each gateway);
- in_flight back to 0 on every replica, and m3gate_requests_in_flight 0, once the load stops;
- every replica's prefix index within its capacity at every sample;
- open file descriptors at the end (idle) no more than at the end of warm-up plus a small slack.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from loadtests.lib.harness import write_results
from loadtests.robustness.chaos import CLIENT_KEY, MODEL, POOL, Cluster, classify_stream

RSS_GROWTH_LIMIT = 0.05
FD_SLACK = 16  # idle keep-alive connections to replicas and Redis come and go


@dataclass
class Sample:
    t: float  # seconds since the start
    gateway: int
    rss_mb: float
    fds: int
    in_flight: int
    prefix_blocks: int
    prefix_capacity: int
    prefix_over: int  # replicas whose index exceeds its capacity


def sample_gateway(cluster: Cluster, index: int, t: float) -> Sample:
    import psutil

    gw = cluster.gws[index]
    proc = psutil.Process(gw.pid)
    replicas = cluster.pools(gw)[POOL]["replicas"].values()
    return Sample(
        t=round(t, 1), gateway=index, rss_mb=round(proc.memory_info().rss / 1e6, 2), fds=proc.num_fds(),
        in_flight=sum(r["in_flight"] for r in replicas),
        prefix_blocks=sum(r["prefix_index_blocks"] for r in replicas),
        prefix_capacity=sum(r["prefix_index_capacity"] for r in replicas),
        prefix_over=sum(r["prefix_index_blocks"] > r["prefix_index_capacity"] for r in replicas),
    )


_IN_FLIGHT = re.compile(r"^m3gate_requests_in_flight\{[^}]*\}\s+([0-9.e+-]+)$", re.M)


def requests_in_flight(url: str) -> float:
    return sum(float(v) for v in _IN_FLIGHT.findall(httpx.get(url + "/metrics", timeout=5).text))


@dataclass
class MixedLoad:
    """Closed-loop mixed traffic until stopped; outcomes counted by kind."""

    urls: Sequence[str]
    concurrency: int = 8
    sessions: int = 400
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    _stop: asyncio.Event | None = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        self._stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await asyncio.gather(*(self._worker(http, i) for i in range(self.concurrency)))

    async def _worker(self, http: aiohttp.ClientSession, worker: int) -> None:
        rng = random.Random(worker)
        assert self._stop is not None
        n = 0
        while not self._stop.is_set():
            n += 1
            kind = rng.choices(["chat_stream", "chat", "completions", "responses", "messages", "hangup", "refused"],
                               [40, 15, 10, 10, 10, 8, 7])[0]
            try:
                await self._one(http, rng, kind, n)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self.outcomes[f"{kind}:client_error"] += 1
                if len(self.problems) < 20:
                    self.problems.append(f"{kind}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0)

    async def _one(self, http: aiohttp.ClientSession, rng: random.Random, kind: str, n: int) -> None:
        url = self.urls[rng.randrange(len(self.urls))]
        session = f"soak-{rng.randrange(self.sessions)}"
        # a per-session prefix (prefix affinity, sessions) of varied length, and a unique tail: new prefix blocks
        # always, and new text for the gateway's token-count cache (8M characters: full within the warm-up)
        prefix = f"Session {session}. " + "Context that repeats across this session's turns. " * rng.randrange(5, 60)
        tail = f"turn {n} of worker {id(rng) % 997}: " + " ".join(
            f"w{rng.randrange(10**6)}" for _ in range(rng.randrange(30, 900)))
        headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-session-id": session}
        max_tokens = rng.randrange(4, 40)
        if kind in ("chat_stream", "hangup", "chat"):
            body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": kind != "chat",
                                    "messages": [{"role": "system", "content": prefix},
                                                 {"role": "user", "content": tail}]}
            path = "/v1/chat/completions"
        elif kind == "completions":
            body, path = {"model": MODEL, "prompt": prefix + tail, "max_tokens": max_tokens,
                          "stream": rng.random() < 0.5}, "/v1/completions"
        elif kind == "responses":
            body, path = {"model": MODEL, "input": prefix + tail, "max_output_tokens": max_tokens,
                          "stream": rng.random() < 0.5}, "/v1/responses"
        elif kind == "messages":
            body, path = {"model": MODEL, "max_tokens": max_tokens, "system": prefix, "stream": rng.random() < 0.5,
                          "messages": [{"role": "user", "content": tail}]}, "/v1/messages"
        else:  # refused by the gateway: bad JSON, a negative max_tokens, an unknown model
            raw = rng.choice([b"{not json", b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], '
                              b'"max_tokens": -3}' % MODEL.encode(), b'{"model": "nope", "messages": []}'])
            async with http.post(url + "/v1/chat/completions", data=raw, headers=headers) as resp:
                await resp.read()
                self.outcomes["refused:4xx" if 400 <= resp.status < 500 else f"refused:{resp.status}"] += 1
            return
        async with http.post(url + path, json=body, headers=headers) as resp:
            if kind == "hangup":  # read a little of the stream, then leave
                async for _ in resp.content.iter_any():
                    break
                resp.close()
                self.outcomes["hangup"] += 1
                return
            raw = await resp.read()
            status = resp.status
        if status != 200:
            self.outcomes[f"{kind}:{status}"] += 1
            if len(self.problems) < 20:
                self.problems.append(f"{kind}: {status} {raw[:200]!r}")
            return
        if body.get("stream") and path in ("/v1/chat/completions", "/v1/completions"):
            verdict = classify_stream(status, raw, None)[0]
            self.outcomes[f"{kind}:{verdict}"] += 1
        else:
            self.outcomes[f"{kind}:ok"] += 1


@dataclass
class SoakResult:
    minutes: float
    requests: dict[str, int]
    problems: list[str]
    restarts: int
    reloads: int
    warmup_s: float
    rss_warm_mb: list[float]
    rss_end_mb: list[float]
    rss_growth: list[float]
    fds_warm: list[int]
    fds_end: list[int]
    in_flight_idle: list[int]
    requests_in_flight_idle: list[float]
    prefix_max_blocks: list[int]
    prefix_capacity: list[int]
    prefix_over_samples: int
    gateways_alive: bool
    samples: list[dict[str, Any]]

    @property
    def checks(self) -> dict[str, bool]:
        return {
            f"RSS growth after warm-up < {RSS_GROWTH_LIMIT:.0%}": all(g < RSS_GROWTH_LIMIT for g in self.rss_growth),
            "in_flight back to 0 when idle": all(n == 0 for n in self.in_flight_idle)
            and all(n == 0 for n in self.requests_in_flight_idle),
            "prefix index within its bound": self.prefix_over_samples == 0,
            "file descriptors stable": all(end <= warm + FD_SLACK for end, warm in zip(self.fds_end, self.fds_warm,
                                                                                  strict=True)),
            "gateways alive": self.gateways_alive,
        }

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


def run_soak(minutes: float = 30.0, *, warmup_fraction: float = 0.2, restart_every_s: float | None = None,
             reload_every_s: float | None = None, sample_every_s: float = 5.0, concurrency: int = 8,
             log: Callable[[str], None] = print) -> SoakResult:
    duration = minutes * 60
    warmup_s = max(20.0, duration * warmup_fraction)
    restart_every_s = restart_every_s or max(20.0, duration / 12)
    reload_every_s = reload_every_s or max(25.0, duration / 10)
    samples: list[Sample] = []
    restarts = reloads = 0
    with Cluster(kv_blocks=256, sim_args=("--speed", "4", "--seed", "3", "--mean-output-tokens", "24")) as cluster:
        load = MixedLoad([gw.url for gw in cluster.gws], concurrency=concurrency)
        started = time.monotonic()
        stop = threading.Event()
        errors: list[str] = []

        def chores() -> None:
            nonlocal restarts, reloads
            next_sample = next_restart = next_reload = 0.0
            next_restart, next_reload = restart_every_s, reload_every_s
            victim = 0
            while not stop.is_set():
                t = time.monotonic() - started
                try:
                    if t >= next_sample:
                        for i in range(len(cluster.gws)):
                            samples.append(sample_gateway(cluster, i, t))
                        next_sample += sample_every_s
                    if t >= next_restart:
                        cluster.restart_sim(victim % len(cluster.sims))
                        victim += 1
                        restarts += 1
                        next_restart += restart_every_s
                    if t >= next_reload:
                        urls = [s.url for s in cluster.sims]
                        cluster.reload_all(urls[:reloads % len(urls)] + urls[reloads % len(urls) + 1:])
                        time.sleep(2.0)
                        cluster.reload_all(urls)
                        reloads += 1
                        next_reload += reload_every_s
                except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
                    errors.append(f"t={t:.0f}s {type(exc).__name__}: {exc}")
                stop.wait(0.2)

        async def drive() -> None:
            task = asyncio.create_task(load.run())
            last = 0.0
            while (elapsed := time.monotonic() - started) < duration:
                await asyncio.sleep(min(5.0, duration - elapsed))
                if elapsed - last >= 60 or elapsed >= duration - 5:
                    last = elapsed
                    total = sum(load.outcomes.values())
                    s = samples[-2:] if samples else []
                    log(f"  soak {elapsed / 60:5.1f} min: {total} requests, restarts {restarts}, reloads {reloads}, "
                        + ", ".join(f"gw{x.gateway} RSS {x.rss_mb} MB fds {x.fds} in_flight {x.in_flight} "
                                    f"prefix {x.prefix_blocks}/{x.prefix_capacity}" for x in s))
            load.stop()
            await asyncio.wait_for(task, 90)

        thread = threading.Thread(target=chores, daemon=True)
        thread.start()
        try:
            asyncio.run(drive())
        finally:
            stop.set()
            thread.join(30)
        cluster.wait_all_available(30)
        time.sleep(3.0)  # idle: streams closed, health polled, shared-state snapshots expired
        end_t = time.monotonic() - started
        final = [sample_gateway(cluster, i, end_t) for i in range(len(cluster.gws))]
        idle_metric = [requests_in_flight(gw.url) for gw in cluster.gws]
        alive = all(gw.alive() for gw in cluster.gws)
    problems = errors + load.problems
    warm, end, growth, fds_warm = [], [], [], []
    for i in range(len(final)):
        mine = [s for s in samples if s.gateway == i]
        at_warm = [s for s in mine if s.t <= warmup_s][-1] if any(s.t <= warmup_s for s in mine) else mine[0]
        warm.append(at_warm.rss_mb)
        end.append(final[i].rss_mb)
        growth.append(round((final[i].rss_mb - at_warm.rss_mb) / at_warm.rss_mb, 4))
        fds_warm.append(max(s.fds for s in mine if s.t <= warmup_s) if any(s.t <= warmup_s for s in mine)
                        else mine[0].fds)
    return SoakResult(
        minutes=minutes, requests=dict(sorted(load.outcomes.items())), problems=problems, restarts=restarts,
        reloads=reloads, warmup_s=warmup_s, rss_warm_mb=warm, rss_end_mb=end, rss_growth=growth, fds_warm=fds_warm,
        fds_end=[s.fds for s in final], in_flight_idle=[s.in_flight for s in final],
        requests_in_flight_idle=idle_metric,
        prefix_max_blocks=[max(s.prefix_blocks for s in samples if s.gateway == i) for i in range(len(final))],
        prefix_capacity=[final[i].prefix_capacity for i in range(len(final))],
        prefix_over_samples=sum(s.prefix_over for s in samples + final), gateways_alive=alive,
        samples=[asdict(s) for s in samples + final],
    )


def summary(result: SoakResult) -> str:
    total = sum(result.requests.values())
    failed = sum(v for k, v in result.requests.items() if not (k.endswith(":ok") or k in ("hangup", "refused:4xx")))
    lines = [
        "| figure | gateway 1 | gateway 2 | target |",
        "|---|---:|---:|---|",
        f"| RSS at end of warm-up ({result.warmup_s:.0f} s) | {result.rss_warm_mb[0]} MB | {result.rss_warm_mb[1]} MB "
        "| — |",
        f"| RSS at the end | {result.rss_end_mb[0]} MB | {result.rss_end_mb[1]} MB | — |",
        f"| RSS growth after warm-up | {result.rss_growth[0]:+.1%} | {result.rss_growth[1]:+.1%} | < "
        f"{RSS_GROWTH_LIMIT:.0%} |",
        f"| open fds: end of warm-up (max) → end (idle) | {result.fds_warm[0]} → {result.fds_end[0]} | "
        f"{result.fds_warm[1]} → {result.fds_end[1]} | no growth (slack {FD_SLACK}) |",
        f"| in_flight on replicas when idle (GET /admin/pools) | {result.in_flight_idle[0]} | "
        f"{result.in_flight_idle[1]} | 0 |",
        f"| m3gate_requests_in_flight when idle | {result.requests_in_flight_idle[0]:g} | "
        f"{result.requests_in_flight_idle[1]:g} | 0 |",
        f"| prefix index: most blocks seen / capacity | {result.prefix_max_blocks[0]} / {result.prefix_capacity[0]} | "
        f"{result.prefix_max_blocks[1]} / {result.prefix_capacity[1]} | within (samples over: "
        f"{result.prefix_over_samples}) |",
        "",
        f"{result.minutes:g} min, {total:,} requests ({failed} not ok, counting client-side errors during replica "
        f"restarts), {result.restarts} replica restarts, {result.reloads} reload pairs; "
        + ", ".join(f"{k} {v:,}" for k, v in result.requests.items()),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.robustness.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup-fraction", type=float, default=None,
                        help="share of the run before the RSS reference is taken (default 0.2; 0.4 under 5 min)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` blocks stop the processes started here
    print(f"soak: {args.minutes:g} min, 3 replicas, 2 gateways, private Redis, concurrency {args.concurrency}",
          flush=True)
    warmup = args.warmup_fraction if args.warmup_fraction is not None else (0.4 if args.minutes < 5 else 0.2)
    result = run_soak(args.minutes, warmup_fraction=warmup, concurrency=args.concurrency,
                      log=lambda line: print(line, flush=True))
    md = summary(result)
    print()
    print(md)
    for name, ok in result.checks.items():
        print(f"- {'pass' if ok else 'FAIL'}: {name}")
    for problem in result.problems[:20]:
        print(f"- problem: {problem}")
    print(f"results: {write_results(args.out, 'soak', asdict(result), md)}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
