"""`server.workers: 2` against one process: requests per second, CPU per request, and prefix affinity across workers.

    python -m loadtests.bench.workers [--quick] [--rounds 4] [--seconds 4] [--concurrency 32] [--replicas 4]
                                      [--skip-affinity] [--out DIR]

Throughput: zero-latency replicas (loadtests/bench/scale.py's fleet: `--replicas` ports of one asyncio process)
behind three gateways started side by side: one process as deployed by default (`server.workers: 1`, memory state),
the same with `state: redis://...` (what sharing costs one process), and two workers (`server.workers: 2`: the
supervisor and its two processes, sharing state through Redis, as workers > 1 needs); the Redis is the bench's own
(loadtests/lib/private_redis.py), a database per gateway. A closed loop of `--concurrency` keep-alive connections
(a bare asyncio client on uvloop: about a fifth of aiohttp's CPU per request) sends non-streaming chat requests to
each in turn, interleaved round by round (the order alternating); each one's req/s is
the median of its rounds, and the ratio 2 workers ÷ 1 process is printed (goal ≥ 1.7×). The gateways' CPU
(/proc/PID/stat: the supervisor and its workers together) per request is read around each segment, and so are this
process's (the load generator's) and the fleet's: on a 2-core machine all three share the two cores (with whatever
else runs there: the load average is recorded), so the measured ratio is bounded by what they leave; the cores the
gateway kept busy are printed per variant. The ratio a gateway with two cores of its
own would reach is printed beside it, from the CPU per request: 2 × (1 process's ÷ 2 workers'), the ceiling of two
cores over the ceiling of one.

Affinity across workers: the policies bench's agent workload (loadtests/bench/policies.py: multi-turn sessions
sharing system prompts, histories growing turn by turn; shorter with --quick) on four simulated replicas whose KV
holds part of the working set, through one process, then through two workers with each request sent to the other
worker's own port than the last (`server.worker_port_base`), so a session's consecutive turns reach different
processes. The replicas' prefix-cache hit rate (their /metrics) should match one process's (goal: within 5 points):
the workers learn each other's dispatches and session pins through Redis.

Results in `--out` (default loadtests/results/<time>-workers/): results.json (loadtests/lib/results.py) and
workers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.cli.launcher import child_pids, consecutive_free_ports
from loadtests.bench.overhead import chat_body
from loadtests.bench.policies import KV_BLOCKS, REPLICAS, SIM_ARGS, agent_spec
from loadtests.bench.scale import Fleet, scale_config
from loadtests.lib.client import Target
from loadtests.lib.harness import execute, run_dir
from loadtests.lib.private_redis import PrivateRedis
from loadtests.lib.replicas import GatewayProc, cpu_seconds, gateway_config, raise_fd_limit, sim_pool
from loadtests.lib.results import Results
from loadtests.lib.workload import build_plan

GOAL_RATIO = 1.7
_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)")


class Gateway:
    """A gateway under test with `workers` processes: its URL, every PID whose CPU is its own, its workers' ports."""

    def __init__(self, config: dict[str, Any], workers: int) -> None:
        base = consecutive_free_ports(workers) if workers > 1 else None
        server = {**config.get("server", {}), "workers": workers}
        if base is not None:
            server["worker_port_base"] = base
        self.proc = GatewayProc({**config, "server": server}, timeout=120)
        self.url = self.proc.url
        self.worker_urls = [f"http://127.0.0.1:{base + i}" for i in range(workers)] if base else [self.url]
        for url in self.worker_urls:
            _wait_ready(url)
        self.pids = (self.proc.pid, *sorted(child_pids(self.proc.pid)))
        assert len(self.pids) == (1 if workers == 1 else workers + 1), f"processes: {self.pids}"

    def stop(self) -> None:
        self.proc.stop()


def _wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Client(asyncio.Protocol):
    """One keep-alive connection sending the same request back to back: HTTP/1.1 bytes written and a response
    counted when its body is complete (content-length, or a chunked body's last chunk). A tenth of aiohttp's CPU per
    request, so that on 2 cores the gateway, not the load generator, gets the CPU."""

    def __init__(self, request: bytes, loop_state: _LoopState) -> None:
        self.request = request
        self.state = loop_state
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        length = _CONTENT_LENGTH.search(head)
        if length is not None:
            if len(self.buf) < end + 4 + int(length.group(1)):
                return
        elif not self.buf.endswith(b"0\r\n\r\n"):  # a chunked body's last chunk
            return
        ok = head.startswith(b"http/1.1 200")
        self.buf = b""
        assert self.transport is not None
        if self.state.count(ok):
            self.transport.write(self.request)
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.closed += 1
        if self.state.closed >= self.state.connections:
            self.state.done.set()


class _LoopState:
    def __init__(self, connections: int, measure_from: float, end: float) -> None:
        self.connections, self.measure_from, self.end = connections, measure_from, end
        self.ok = self.errors = self.closed = 0
        self.done = asyncio.Event()

    def count(self, ok: bool) -> bool:
        """Counts an answer (after the warm-up); False when the segment is over (the connection closes)."""
        now = time.perf_counter()
        if now >= self.measure_from:
            if ok:
                self.ok += 1
            else:
                self.errors += 1
        return now < self.end


def closed_loop_segment(url: str, body: dict[str, Any], concurrency: int, seconds: float, pids: Sequence[int],
                        warmup_s: float = 0.3) -> dict[str, float]:
    """`concurrency` connections sending back to back for warm-up + `seconds`: requests answered and errors after
    the warm-up, wall seconds, and the CPU seconds of `pids` (the gateway) over the measured part."""
    host, port = url.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(payload)}\r\n\r\n").encode() + payload

    async def go() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        state = _LoopState(concurrency, start + warmup_s, start + warmup_s + seconds)
        for _ in range(concurrency):
            await loop.create_connection(lambda: _Client(request, state), host, int(port))
        await asyncio.sleep(max(0.0, state.measure_from - time.perf_counter()))
        cpu0 = sum(cpu_seconds(pid) for pid in pids)
        await asyncio.wait_for(state.done.wait(), seconds + 30)
        wall = max(1e-9, min(time.perf_counter(), state.end) - state.measure_from)
        return {"ok": state.ok, "errors": state.errors, "wall": wall,
                "gw_cpu": sum(cpu_seconds(pid) for pid in pids) - cpu0}

    return asyncio.run(go())


VARIANTS = {"1 process": (1, False), "1 process, Redis state": (1, True), "2 workers": (2, True)}
"""name → (workers, state in Redis): the default deployment, the same with the sharing the workers need, 2 workers"""


def throughput(rounds: int, seconds: float, concurrency: int, replicas: int, redis: PrivateRedis
               ) -> dict[str, dict[str, Any]]:
    """Per variant: req/s (median of its rounds), and CPU per request (ms) of the gateway, the load generator and
    the fleet, over all rounds. Each variant with Redis state has a database of its own (no one else's dispatches)."""
    fleet = Fleet(replicas)
    gateways: dict[str, Gateway] = {}
    try:
        for db, (name, (workers, shared)) in enumerate(VARIANTS.items(), start=1):
            config = scale_config(fleet.urls)
            if shared:
                config["state"] = f"redis://127.0.0.1:{redis.port}/{db}"
            gateways[name] = Gateway(config, workers)
        time.sleep(3.0)  # every replica probed and scraped by every process
        body = chat_body(16, False)
        for gw in gateways.values():  # warm-up: connections to the replicas, caches
            closed_loop_segment(gw.url, body, concurrency, 1.0, ())
        per: dict[str, dict[str, Any]] = {name: {"rps": [], "ok": 0, "gw_cpu": 0.0, "load_cpu": 0.0,
                                                 "fleet_cpu": 0.0, "errors": 0} for name in gateways}
        order = list(gateways)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                gw = gateways[name]
                load0, fleet0 = _self_cpu(), cpu_seconds(fleet.proc.pid)
                seg = closed_loop_segment(gw.url, body, concurrency, seconds, gw.pids)
                row = per[name]
                rps, per_request = seg["ok"] / seg["wall"], seg["gw_cpu"] / max(1.0, seg["ok"]) * 1e3
                row["rps"].append(rps)
                row["ok"] += seg["ok"]
                row["errors"] += seg["errors"]
                row["gw_cpu"] += seg["gw_cpu"]
                row["load_cpu"] += _self_cpu() - load0
                row["fleet_cpu"] += cpu_seconds(fleet.proc.pid) - fleet0
                print(f"  round {r + 1} {name}: {rps:,.0f} req/s, gateway CPU {per_request:.3f} ms/request"
                      f"{', errors ' + str(seg['errors']) if seg['errors'] else ''}", flush=True)
        out: dict[str, dict[str, Any]] = {}
        for name, row in per.items():
            ok = max(1, row["ok"])
            out[name] = {"rps": statistics.median(row["rps"]), "per_round_rps": row["rps"],
                         "gw_cpu_ms": row["gw_cpu"] / ok * 1e3, "load_cpu_ms": row["load_cpu"] / ok * 1e3,
                         "fleet_cpu_ms": row["fleet_cpu"] / ok * 1e3, "errors": row["errors"]}
        return out
    finally:
        for gw in gateways.values():
            gw.stop()
        fleet.stop()


class AlternatingWorkers(Target):
    """Every request to the next worker's own port: a session's consecutive turns reach different processes."""

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__(gateway=urls[0])
        self.urls = list(urls)
        self._next = 0

    @property
    def label(self) -> str:
        return f"{len(self.urls)} workers, alternating"

    def pick(self) -> str:
        self._next += 1
        return self.urls[self._next % len(self.urls)]


def affinity(quick: bool, redis_url: str, folder: Path) -> dict[int, float | None]:
    """Per gateway (1, 2 processes): the replicas' prefix-cache hit rate on the agent workload."""
    spec = agent_spec(quick)
    if quick:
        spec = {**spec, "duration_s": 15, "drain_s": 20}
    plan = build_plan(spec, source="bench_workers")
    out: dict[int, float | None] = {}
    with sim_pool(REPLICAS, 32768, [*SIM_ARGS, "--kv-blocks", str(KV_BLOCKS)]) as pool:
        for workers in (1, 2):
            pool.reset()
            config = gateway_config(pool.urls, policy="prefix_affinity", max_model_len=32768)
            if workers > 1:  # the one process is the default deployment: memory state
                config["state"] = redis_url
            gw = Gateway(config, workers)
            try:
                time.sleep(0.6)  # one scrape of /metrics: the gateway knows the KV sizes
                target = AlternatingWorkers(gw.worker_urls) if workers > 1 else Target(gateway=gw.url)
                report, _ = execute(plan, target, replicas=pool.urls, out_dir=folder / f"affinity-{workers}",
                                    quiet=True, progress=False, plots=False)
            finally:
                gw.stop()
            out[workers] = (report.get("prefix_cache") or {}).get("rate")
            o = report["overall"]
            print(f"  affinity workers={workers}: hit rate {_fmt(out[workers], '.1%')}, "
                  f"{o['completed']}/{report['sent']} ok", flush=True)
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


ONE, SHARED, TWO = VARIANTS


def report(tp: dict[str, dict[str, Any]], hits: dict[int, float | None], concurrency: int) -> str:
    lines = [f"Closed loop c={concurrency}, zero-latency replicas, non-streaming chat; medians of interleaved rounds",
             "", "| gateway | req/s | gateway cores busy | gateway CPU ms/req | load generator CPU ms/req | "
             "replicas CPU ms/req |", "|---|---|---|---|---|---|"]
    for name, row in tp.items():
        lines.append(f"| {name} | {row['rps']:,.0f} | {row['rps'] * row['gw_cpu_ms'] / 1e3:.2f} | "
                     f"{row['gw_cpu_ms']:.3f} | {row['load_cpu_ms']:.3f} | {row['fleet_cpu_ms']:.3f} |")
    lines += ["", f"req/s, 2 workers ÷ 1 process: {_fmt(_ratio(tp[TWO]['rps'], tp[ONE]['rps']), '.2f')}×",
              f"2 cores' ceiling ÷ 1 core's, from the gateway's CPU per request: {_fmt(_projected(tp), '.2f')}×",
              "", "Prefix-cache hit rate (replicas' /metrics), agent workload, turns alternating between the workers:",
              "", "| gateway | hit rate |", "|---|---|",
              f"| 1 process | {_fmt(hits.get(1), '.1%')} |", f"| 2 workers | {_fmt(hits.get(2), '.1%')} |"]
    return "\n".join(lines)


def _projected(tp: dict[str, dict[str, Any]]) -> float | None:
    """Two cores' req/s over one core's for a CPU-bound gateway: 2 × (1 process's CPU per request ÷ 2 workers')."""
    ratio = _ratio(tp[ONE]["gw_cpu_ms"], tp[TWO]["gw_cpu_ms"])
    return None if ratio is None else 2.0 * ratio


def results_of(tp: dict[str, dict[str, Any]], hits: dict[int, float | None], args: argparse.Namespace,
               load_average: float | None = None) -> Results:
    results = Results("workers", vars(args),
                      reference="one gateway process (server.workers: 1, memory state), same run")
    one, shared, two = tp[ONE], tp[SHARED], tp[TWO]
    results.add("req/s, 2 workers ÷ 1 process (load generator on the same cores)", _ratio(two["rps"], one["rps"]),
                "×", at_least=GOAL_RATIO)
    results.add("req/s, 2 workers", two["rps"], "req/s", reference="1 process", reference_value=one["rps"])
    results.add("2 cores' ceiling ÷ 1 core's, from the gateway's CPU per request", _projected(tp), "×")
    results.add("gateway cores busy, 2 workers", two["rps"] * two["gw_cpu_ms"] / 1e3, "cores",
                reference="1 process", reference_value=one["rps"] * one["gw_cpu_ms"] / 1e3)
    results.add("machine load average (1 min) after the throughput rounds", load_average, "")
    results.add("gateway CPU per request, 2 workers", two["gw_cpu_ms"], "ms", reference="1 process",
                reference_value=one["gw_cpu_ms"])
    results.add("gateway CPU per request, 1 process with Redis state", shared["gw_cpu_ms"], "ms",
                reference="1 process", reference_value=one["gw_cpu_ms"])
    results.add("load generator CPU per request", two["load_cpu_ms"], "ms", reference="1 process",
                reference_value=one["load_cpu_ms"])
    h1, h2 = hits.get(1), hits.get(2)
    results.add("prefix-cache hit rate, 2 workers alternating", None if h2 is None else h2 * 100, "%",
                reference="1 process", reference_value=None if h1 is None else h1 * 100,
                goal="within 5 points of 1 process's" if h1 is not None else None,
                passed=None if h1 is None or h2 is None else h2 * 100 >= h1 * 100 - 5.0)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 s, the short agent workload")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=4, help="zero-latency replicas (default 4)")
    parser.add_argument("--skip-affinity", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default loadtests/results/<time>-workers/)")
    args = parser.parse_args(argv)
    raise_fd_limit(20_000)
    try:
        import uvloop

        uvloop.install()  # the load generator's own loop: the cheaper, the more CPU is left to the gateway
    except ImportError:
        pass
    rounds, seconds = (2, 3.0) if args.quick else (args.rounds, args.seconds)
    folder = args.out or run_dir("workers")
    folder.mkdir(parents=True, exist_ok=True)
    redis = PrivateRedis()
    redis.start()
    try:
        print(f"throughput: {rounds} rounds of {seconds:g} s, c={args.concurrency}, {os.cpu_count()} cores", flush=True)
        tp = throughput(rounds, seconds, args.concurrency, args.replicas, redis)
        load_average = os.getloadavg()[0]
        print(f"machine load average (1 min) after the rounds: {load_average:.2f}", flush=True)
        hits: dict[int, float | None] = {}
        if not args.skip_affinity:
            print("affinity: the agent workload through 1 process, then 2 workers ...", flush=True)
            hits = affinity(args.quick, redis.url, folder)
    finally:
        redis.stop()
    text = report(tp, hits, args.concurrency)
    print()
    print(text)
    results_of(tp, hits, args, load_average).write(folder)
    (folder / "workers.md").write_text(text + "\n")
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
