"""Chaos suite: failure injection under a steady streaming load through two gateways that share a Redis.

    python -m loadtests.robustness.chaos                 full version (`make chaos`): 20 s Redis outage, longer phases
    python -m loadtests.robustness.chaos --quick         the CI version (tests/chaos runs it under pytest)
    python -m loadtests.robustness.chaos --only kill,redis

Everything listens on 127.0.0.1: three simulated replicas (pools/sim), two `m3gate serve` processes with
`state: redis://...` on a `redis-server` this module starts on a free port (the machine's shared Redis is never
touched), and an asyncio client. Every loop is bounded in time and count; processes are stopped by PID.

For each scenario the load runs through warm-up → fault → recovery, and every request is classified by parsing its
SSE stream:

- succeeded: 200, `data: [DONE]`, no error event;
- failed before first byte: the gateway answered with an error status (its OpenAI-shaped JSON), nothing streamed;
- failed after first byte: 200, then an SSE error event (ends with `[DONE]` for chat): must be 0, a stream whose
  replica fails after the first byte is resumed on another one (stream migration, docs/stream-migration.md);
- silent cut: 200, then the stream ended or broke without an error event (must be 0), or stalled (must be 0).

"retried" is the delta of `m3gate_routing_decisions_total{reason="retry"}` over both gateways, "migrated" that of
`m3gate_stream_migrations_total{outcome="resumed"}` (streams broken by the fault and resumed elsewhere). Time to eject is
from the fault to the replica shown unavailable (or gone) in both gateways' `GET /admin/pools`; time to re-admit is
from the repair to the replica shown available again in both (a replica back in rotation takes new prefixes at once
and existing ones as their replicas' queues demand, policies/placement.py: no request need come to it at once).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import signal
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.lib.harness import write_results
from loadtests.lib.private_redis import PrivateRedis
from pools.replicas import EJECT_MAX_S
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
POOL = "interactive"
CLIENT_KEY = "chaos-client-key-0123456789abcdef"

SCENARIOS = ("kill", "hang", "errors", "drop", "unhealthy", "redis", "reload")
TITLES = {
    "kill": "replica SIGKILLed mid-load (restarted on its port)",
    "hang": "replica hangs (accepts, never answers)",
    "errors": "replica answers 500 to 50% of requests",
    "drop": "replica drops 50% of streams mid-stream",
    "unhealthy": "replica /health 503 while still answering",
    "redis": "Redis stopped, then started again",
    "reload": "reload removes the replica with most sessions",
}


# -- processes ---------------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """Replicas, a private Redis and gateways sharing it, all on loopback. Use as a context manager."""

    replicas: int = 3
    gateways: int = 2
    sim_args: Sequence[str] = ("--speed", "2", "--seed", "7")
    read_timeout_s: float = 2.0
    health_interval_s: float = 0.25
    kv_blocks: int | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    redis_password: str | None = None
    gateway_env: dict[str, str] = field(default_factory=dict)
    sims: list[SimProcess] = field(default_factory=list)
    gws: list[GatewayProcess] = field(default_factory=list)
    redis: PrivateRedis | None = None

    def __enter__(self) -> Cluster:
        try:
            self.redis = PrivateRedis(password=self.redis_password)
            self.redis.start()
            for _ in range(self.replicas):
                self.sims.append(self._start_sim())
            config = self.config([s.url for s in self.sims])
            for _ in range(self.gateways):
                self.gws.append(start_gateway(config, env=self.gateway_env))
            self.wait_all_available()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for gw in self.gws:
            gw.stop()
        for sim in self.sims:
            sim.stop()
        if self.redis is not None:
            self.redis.stop()

    def _start_sim(self, port: int | None = None) -> SimProcess:
        args = list(self.sim_args)
        if self.kv_blocks:
            args += ["--kv-blocks", str(self.kv_blocks)]
        last: Exception | None = None
        for _ in range(20):  # a just-killed replica's port can take a moment to be free again
            try:
                return start_sim(32768, extra_args=args, port=port)
            except RuntimeError as exc:
                last = exc
                if port is None:
                    raise
                time.sleep(0.25)
        raise RuntimeError(f"could not restart the replica on port {port}: {last}")

    def restart_sim(self, index: int) -> SimProcess:
        old = self.sims[index]
        old.kill()
        self.sims[index] = self._start_sim(port=old.port)
        return self.sims[index]

    def config(self, endpoints: Sequence[str]) -> dict[str, Any]:
        assert self.redis is not None
        cfg: dict[str, Any] = {
            "model": MODEL,
            "pools": [{"name": POOL, "max_model_len": 32768, "endpoints": list(endpoints)}],
            "routing": {"policy": "prefix_affinity"},
            "server": {"health_interval_s": self.health_interval_s, "upstream_read_timeout_s": self.read_timeout_s,
                       "upstream_connect_timeout_s": 1.0},
            "classification": {"output_budget": {"enabled": 256, "adaptive": 256, "disabled": 256}},
            "state": self.redis.url,
            "access": {"keys": [{"name": "chaos", "key_sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest(),
                                 "requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000}]},
        }
        for key, value in self.extra_config.items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
        return cfg

    def reload_all(self, endpoints: Sequence[str]) -> None:
        """Write the new config to every gateway's file and ask each to reload (the file watch may beat it)."""
        config = self.config(endpoints)
        for gw in self.gws:
            gw.write_config(config)
        for gw in self.gws:
            httpx.post(gw.url + "/admin/reload", timeout=10)

    def pools(self, gw: GatewayProcess) -> dict[str, Any]:
        return httpx.get(gw.url + "/admin/pools", timeout=5).json()["pools"]

    def wait_all_available(self, timeout: float = EJECT_MAX_S + 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for gw in self.gws:
                replicas = self.pools(gw)[POOL]["replicas"]
                ok &= len(replicas) == len(self.sims) and all(r["available"] for r in replicas.values())
            if ok:
                return
            time.sleep(0.1)
        raise RuntimeError("replicas did not all become available in the gateways")

    def heal_all(self) -> None:
        for sim in self.sims:
            if sim.alive:
                sim.set_faults(error_rate=0.0, hang=False, drop_mid_stream=0.0, unhealthy=False,
                               added_latency_ms=0)


# -- the client ----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    gateway: int
    session: str
    t_start: float
    t_end: float = 0.0
    status: int = 0
    endpoint: str = ""
    kind: str = ""  # ok | before_first_byte | after_first_byte | silent_cut | stalled
    events: int = 0  # token events before the end
    detail: str = ""


def classify_stream(status: int, body: bytes, broke: str | None) -> tuple[str, int, str]:
    """(kind, token events, detail) of one streamed chat response, from its raw bytes."""
    if status != 200:
        try:
            err = json.loads(body)["error"]
            return "before_first_byte", 0, f"{status} {err.get('code')}: {str(err.get('message'))[:120]}"
        except (ValueError, KeyError, TypeError):
            return "before_first_byte", 0, f"{status} (not OpenAI-shaped: {body[:120]!r})"
    events = 0
    error: str | None = None
    done = False
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                return "silent_cut", events, f"unparseable event {data[:80]!r}"
            if isinstance(obj, dict) and "error" in obj:
                error = str(obj["error"].get("message") if isinstance(obj["error"], dict) else obj["error"])
            elif not done:
                events += 1
    if error is not None and done:
        return "after_first_byte", events, error[:160]
    if broke:
        return "silent_cut", events, f"connection broke without an error event: {broke}"
    if not done:
        return "silent_cut", events, "stream ended without [DONE] or an error event"
    return "ok", events, ""


@dataclass
class Load:
    """Closed-loop streaming chat load, spread over gateways and sessions, until stopped (bounded by max_requests)."""

    urls: Sequence[str]
    concurrency: int = 12
    sessions: int = 48
    max_tokens: int = 48
    request_timeout_s: float = 20.0
    max_requests: int = 100_000
    seed: int = 1
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event | None = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await asyncio.gather(*(self._worker(session, i) for i in range(self.concurrency)))

    async def _worker(self, http: aiohttp.ClientSession, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        assert self._stop is not None
        turn = 0
        while not self._stop.is_set() and len(self.outcomes) < self.max_requests:
            turn += 1
            gw = rng.randrange(len(self.urls))
            sid = f"s{rng.randrange(self.sessions)}"
            out = Outcome(gateway=gw, session=sid, t_start=time.monotonic())
            self.outcomes.append(out)
            await self.one(http, self.urls[gw], sid, turn, out)
            await asyncio.sleep(0)

    async def one(self, http: aiohttp.ClientSession, url: str, sid: str, turn: int, out: Outcome) -> None:
        # A long per-session prefix (prefix affinity, session pins) and a short varying tail.
        system = f"You are assistant {sid}. " + ("Remember the conversation so far. " * 40)
        body = {"model": MODEL, "stream": True, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"turn {turn}: continue the story"}]}
        headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-session-id": sid}
        raw = bytearray()
        broke: str | None = None
        try:
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                out.status = resp.status
                out.endpoint = resp.headers.get("x-m3gate-endpoint", "")
                try:
                    async for chunk in resp.content.iter_any():
                        raw += chunk
                except (aiohttp.ClientError, OSError) as exc:
                    broke = type(exc).__name__
        except asyncio.TimeoutError:
            out.t_end = time.monotonic()
            out.kind, out.detail = "stalled", f"no end within {self.request_timeout_s} s (status {out.status})"
            return
        except (aiohttp.ClientError, OSError) as exc:
            out.t_end = time.monotonic()
            out.kind, out.detail = ("before_first_byte" if not out.status else "silent_cut"), repr(exc)[:160]
            return
        out.t_end = time.monotonic()
        out.kind, out.events, out.detail = classify_stream(out.status, bytes(raw), broke)


# -- observation ---------------------------------------------------------------------------------------------------

_RETRY = re.compile(r'^m3gate_routing_decisions_total\{[^}]*reason="retry"[^}]*\}\s+([0-9.e+-]+)$', re.M)
_RESUMED = re.compile(r'^m3gate_stream_migrations_total\{[^}]*outcome="resumed"[^}]*\}\s+([0-9.e+-]+)$', re.M)
_REDIS_UP = re.compile(r"^m3gate_redis_up\s+([0-9.e+-]+)$", re.M)


def metric_retries(gw: GatewayProcess) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    return sum(float(v) for v in _RETRY.findall(text))


def metric_migrations(gw: GatewayProcess) -> float:
    return sum(float(v) for v in _RESUMED.findall(httpx.get(gw.url + "/metrics", timeout=5).text))


def redis_up(gw: GatewayProcess) -> bool | None:
    m = _REDIS_UP.search(httpx.get(gw.url + "/metrics", timeout=5).text)
    return None if m is None else float(m.group(1)) == 1.0


class Watcher:
    """Polls every gateway's /admin/pools (and redis_up) every `interval_s` in a thread: availability timelines."""

    def __init__(self, cluster: Cluster, interval_s: float = 0.05) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, dict[str, bool], bool | None]] = []  # (t, gw, url → available, redis)
        self._stop = False
        self._thread: Any = None

    def __enter__(self) -> Watcher:
        import threading

        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop:
                for i, gw in enumerate(self.cluster.gws):
                    try:
                        replicas = client.get(gw.url + "/admin/pools").json()["pools"][POOL]["replicas"]
                        up = _REDIS_UP.search(client.get(gw.url + "/metrics").text)
                    except (httpx.HTTPError, ValueError, KeyError):
                        continue
                    self.samples.append((time.monotonic(), i, {u: r["available"] for u, r in replicas.items()},
                                         None if up is None else float(up.group(1)) == 1.0))
                time.sleep(self.interval_s)

    def first_time(self, since: float, predicate: Callable[[dict[str, bool], bool | None], bool]) -> float | None:
        """Seconds from `since` until every gateway's samples satisfied `predicate` (each gateway's first)."""
        firsts: dict[int, float] = {}
        for t, gw, avail, redis in self.samples:
            if t >= since and gw not in firsts and predicate(avail, redis):
                firsts[gw] = t
        if len(firsts) < len(self.cluster.gws):
            return None
        return max(firsts.values()) - since


# -- scenarios -----------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    warmup_s: float = 3.0
    fault_s: float = 10.0
    recover_s: float = 8.0
    redis_outage_s: float = 20.0
    concurrency: int = 12
    max_tokens: int = 48

    @classmethod
    def quick(cls) -> Settings:
        return cls(warmup_s=1.5, fault_s=3.5, recover_s=3.0, redis_outage_s=4.0, concurrency=10, max_tokens=40)


@dataclass
class ScenarioResult:
    name: str
    title: str
    sent: int = 0
    succeeded: int = 0
    retried: int = 0
    migrated: int = 0  # streams resumed on another replica after their replica failed mid-stream
    failed_before_first_byte: int = 0
    failed_after_first_byte: int = 0
    silent_cuts: int = 0
    stalled: int = 0
    failed_before_first_token: int = 0  # of failed_after_first_byte: 200 and headers, then an error before any token
    eject_s: float | None = None
    readmit_s: float | None = None
    target_replica: str = ""
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # a few examples

    @property
    def passed(self) -> bool:
        ok = self.failed_before_first_byte == 0 and self.silent_cuts == 0 and self.stalled == 0 and self.sent > 0
        ok &= self.failed_after_first_byte == 0  # a stream broken after its first byte is resumed elsewhere
        if self.name in ("kill", "hang", "unhealthy", "redis", "reload"):
            ok &= self.eject_s is not None and self.readmit_s is not None  # seen going, and coming back
        return ok


def _most_sessions(outcomes: Sequence[Outcome], fallback: str) -> str:
    """The replica serving the most sessions now: where each session's latest successful request went."""
    last: dict[str, str] = {}
    for o in outcomes:
        if o.kind == "ok" and o.endpoint:
            last[o.session] = o.endpoint
    counts = Counter(last.values())
    return counts.most_common(1)[0][0] if counts else fallback


def run_scenario(cluster: Cluster, name: str, settings: Settings, target_index: int = 0) -> ScenarioResult:
    """One scenario under load; the cluster is healthy again when it returns."""
    result = ScenarioResult(name, TITLES[name])
    cluster.heal_all()
    cluster.wait_all_available()
    retries_before = sum(metric_retries(gw) for gw in cluster.gws)
    migrated_before = sum(metric_migrations(gw) for gw in cluster.gws)
    load = Load([gw.url for gw in cluster.gws], concurrency=settings.concurrency, max_tokens=settings.max_tokens,
                seed=zlib.crc32(name.encode()) & 0xFFFF)
    target = cluster.sims[target_index]
    marks: dict[str, float] = {}

    async def drive() -> None:
        task = asyncio.create_task(load.run())
        await asyncio.sleep(settings.warmup_s)
        await asyncio.to_thread(inject)
        await asyncio.sleep(settings.redis_outage_s if name == "redis" else settings.fault_s)
        await asyncio.to_thread(repair)
        await asyncio.sleep(settings.recover_s)
        # A replica ejected several times is back only when its back-off (1 s doubling, at most EJECT_MAX_S) runs
        # out, after its last failed request: keep the load on until both gateways show it available, to measure it.
        until = time.monotonic() + cluster.read_timeout_s + EJECT_MAX_S + 5
        while name != "redis" and readmitted() is None and time.monotonic() < until:
            await asyncio.sleep(0.25)
        load.stop()
        await asyncio.wait_for(task, load.request_timeout_s + 5)

    def readmitted() -> float | None:
        """Seconds from the repair until both gateways showed the replica available again (None: not yet)."""
        repaired = marks.get("repaired")
        url = target.url
        return None if repaired is None else watch.first_time(repaired, lambda a, _r: a.get(url, False))

    def inject() -> None:
        nonlocal target
        marks["fault"] = time.monotonic()
        if name == "kill":
            target.kill()
        elif name == "hang":
            target.set_faults(hang=True)
        elif name == "errors":
            target.set_faults(error_rate=0.5)
        elif name == "drop":
            target.set_faults(drop_mid_stream=0.5)
        elif name == "unhealthy":
            target.set_faults(unhealthy=True)
        elif name == "redis":
            assert cluster.redis is not None
            cluster.redis.stop()
        elif name == "reload":
            url = _most_sessions(load.outcomes, cluster.sims[0].url)
            result.notes.append(f"removed {url} (most sessions)")
            idx = next(i for i, s in enumerate(cluster.sims) if s.url == url)
            target = cluster.sims[idx]
            cluster.reload_all([s.url for s in cluster.sims if s.url != url])
        marks["injected"] = time.monotonic()

    def repair() -> None:
        nonlocal target
        marks["repair"] = time.monotonic()
        if name == "kill":
            idx = cluster.sims.index(target)
            target = cluster.restart_sim(idx)
        elif name == "redis":
            assert cluster.redis is not None
            cluster.redis.start()
        elif name == "reload":
            cluster.reload_all([s.url for s in cluster.sims])
        else:
            target.set_faults(error_rate=0.0, hang=False, drop_mid_stream=0.0, unhealthy=False)
        marks["repaired"] = time.monotonic()

    with Watcher(cluster) as watch:
        asyncio.run(drive())
    result.target_replica = "redis" if name == "redis" else target.url
    kinds = Counter(o.kind for o in load.outcomes)
    result.sent = len(load.outcomes)
    result.succeeded = kinds["ok"]
    result.failed_before_first_byte = kinds["before_first_byte"]
    result.failed_after_first_byte = kinds["after_first_byte"]
    result.silent_cuts = kinds["silent_cut"]
    result.stalled = kinds["stalled"]
    result.failed_before_first_token = sum(o.kind == "after_first_byte" and o.events == 0 for o in load.outcomes)
    result.retried = int(sum(metric_retries(gw) for gw in cluster.gws) - retries_before)
    result.migrated = int(sum(metric_migrations(gw) for gw in cluster.gws) - migrated_before)
    result.failures = [f"{o.kind} via gw{o.gateway} {o.endpoint} after {o.events} events: {o.detail}"
                       for o in load.outcomes
                       if o.kind != "ok"][:8]
    fault, repaired = marks["fault"], marks["repaired"]
    if name == "redis":
        result.eject_s = watch.first_time(fault, lambda _a, up: up is False)
        result.readmit_s = watch.first_time(repaired, lambda _a, up: up is True)
        result.notes.append("eject/re-admit: m3gate_redis_up 0, then 1 again, in both gateways")
    else:
        url = target.url
        result.eject_s = watch.first_time(fault, lambda a, _r: not a.get(url, False))
        result.readmit_s = readmitted()
        if name == "drop":
            result.notes.append("each stream broken mid-way is resumed on another replica; three in a row eject "
                                "the replica (back-off)")
    return result


def run_all(settings: Settings, only: Sequence[str] = SCENARIOS, cluster_kwargs: dict[str, Any] | None = None,
            log: Callable[[str], None] = print) -> list[ScenarioResult]:
    results = []
    with Cluster(**(cluster_kwargs or {})) as cluster:
        for i, name in enumerate(only):
            started = time.monotonic()
            result = run_scenario(cluster, name, settings, target_index=i % len(cluster.sims))
            log(f"  {name:10s} {time.monotonic() - started:5.1f}s  sent={result.sent} ok={result.succeeded} "
                f"retried={result.retried} migrated={result.migrated} before={result.failed_before_first_byte} "
                f"after={result.failed_after_first_byte} cuts={result.silent_cuts + result.stalled} "
                f"{'PASS' if result.passed else 'FAIL'}")
            results.append(result)
        for gw in cluster.gws:
            if not gw.alive():
                raise RuntimeError(f"gateway {gw.url} died:\n{gw.log_tail()}")
    return results


def _fmt_s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def table(results: Sequence[ScenarioResult]) -> str:
    lines = [
        "| scenario | sent | succeeded | retried | migrated | failed before first byte | failed after first byte "
        "(SSE error event) | silent cuts | time to eject | time to re-admit | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.title} | {r.sent} | {r.succeeded} | {r.retried} | {r.migrated} | {r.failed_before_first_byte} | "
            f"{r.failed_after_first_byte} | {r.silent_cuts + r.stalled} | {_fmt_s(r.eject_s)} | "
            f"{_fmt_s(r.readmit_s)} | {'pass' if r.passed else 'FAIL'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.robustness.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short CI version (Redis outage 4 s)")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--redis-outage-s", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write chaos.json and chaos.md here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` blocks stop the processes started here
    settings = Settings.quick() if args.quick else Settings()
    if args.redis_outage_s is not None:
        settings.redis_outage_s = args.redis_outage_s
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {SCENARIOS}")
    print(f"chaos: {len(only)} scenario(s), 3 replicas, 2 gateways, private Redis; {settings}", flush=True)
    started = time.monotonic()
    results = run_all(settings, only, log=lambda line: print(line, flush=True))
    md = table(results)
    print()
    print(md)
    for r in results:
        if r.failed_after_first_byte:
            print(f"- {r.name}: {r.failed_before_first_token} of the {r.failed_after_first_byte} failures after the "
                  "first byte came before any token (headers only)")
        for note in r.notes:
            print(f"- {r.name}: {note}")
        for failure in r.failures if not r.passed else []:
            print(f"- {r.name} FAILURE: {failure}")
    print(f"\n{len(results)} scenarios in {time.monotonic() - started:.0f} s")
    data = {"settings": asdict(settings), "results": [asdict(r) for r in results]}
    print(f"results: {write_results(args.out, 'chaos', data, md)}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
