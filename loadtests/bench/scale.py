"""The gateway's CPU per request as the pool grows, and for long prompts, beside SGLang's Rust router in the same run.

    python -m loadtests.bench.scale [--quick] [--sizes 16,64,256,1024] [--rounds 3] [--seconds 2] [--out DIR]
                                    [--peer sglang-router:cache_aware] [--long-pool 100]

The replicas are zero-latency vLLM-like workers, every one of them a port of one asyncio process (`--fleet`): each
answers a chat completion at once with a canned answer (16 tokens, or 64 streamed SSE events with a usage chunk),
`/health` and a `/metrics` page with the few vLLM series the gateway scrapes, so a fleet of 1,024 costs one process.
For each pool size N, m3gate (prefix_affinity, loadtests.lib.replicas.bench_config) and the peer router are started in
front of the same N workers and measured in interleaved rounds (closed loop, 16 clients; non-streaming, then
streaming): each proxy's CPU seconds (/proc/PID/stat) per request. A proxy's CPU while idle (health checks and
metric scrapes of N replicas, each at its own interval) is measured over two of m3gate's probing rounds (10 s) before
the rounds and taken off, so what is left is the per-request cost (probes come in bursts: short segments at large N
scatter around it). The ratio m3gate ÷ peer is printed per N and mode, and m3gate's cost at
N over its cost at the smallest N (how the decision grows with the pool).

Long prompts: at N = `--long-pool`, one request at a time of ~28K and ~95K tokens (distinct texts, so no tokens
cache helps; the body's `max_model_len` is 131,072), m3gate's and the peer's CPU per request, after a warm-up of
LONG_WARMUP such requests each (not counted: first-use costs are no request's).

Memory (`--phases` picks which of sizes, long and memory run): each proxy alone on a fresh fleet of `--long-pool` workers, RSS (its processes
together) after a warm-up, after 2,000 distinct ~28K-token prompts, after 200 distinct ~400K-token prompts (8 at a
time) and 10 s later: what the prefix index and body handling keep.

`--quick`: N = 16 and 256, one round of two seconds, the long prompts with 8 requests each (24 by default: CPU time
is read in 10 ms ticks). Results in `--out`, by default loadtests/results/<time>-scale/: results.json (m3gate's CPU per
request and idle CPU beside the peer's, informational; loadtests/lib/results.py) and scale.md (the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtests.bench.overhead import chat_body, run_segment
from loadtests.lib.peers import PeerProcess, start_peer
from loadtests.lib.harness import run_dir
from loadtests.lib.replicas import GatewayProc, bench_config, cpu_seconds, raise_fd_limit
from loadtests.lib.results import Results

CONCURRENCY = 16
STREAM_TOKENS = 64
LONG_TOKENS = (28_000, 95_000)
LONG_WARMUP = 4  # long requests each proxy serves (new texts too) before its CPU is read, at each size
HEALTH_INTERVAL_S = 5.0
IDLE_S = 2 * HEALTH_INTERVAL_S  # whole probing rounds: probes come in bursts, one per replica each interval

# ---------------------------------------------------------------------------------------------------------------
# The fleet: N zero-latency workers in one process

_METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n'
    b'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 0.0\n'
    b'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0\n'
    b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100000"} 1.0\n'
)
_STREAM_FLAG = re.compile(rb'"stream"\s*:\s*true')


def _answer(prompt_tokens: int, worker: bytes = b"fleet") -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-" + worker.decode(), "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello " * 16},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 16, "total_tokens": prompt_tokens + 16}})


def _stream(prompt_tokens: int) -> bytes:
    head = {"id": "chatcmpl-fleet", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    events = [orjson.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    events += [orjson.dumps({**head, "choices": [{"index": 0, "delta": {"content": "hello "}}]})] * STREAM_TOKENS
    events.append(orjson.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    events.append(orjson.dumps({**head, "choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": STREAM_TOKENS,
        "total_tokens": prompt_tokens + STREAM_TOKENS}}))
    return b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _response(status: bytes, body: bytes, ctype: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: " +
            str(len(body)).encode() + b"\r\n\r\n" + body)


class _Worker(asyncio.Protocol):
    """A keep-alive HTTP/1.1 server connection that answers every request at once."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.delay_s = delay_s  # each chat answer this late (bench.gateways: load the routers can see)
        self.port = b"fleet"  # its port, in a non-streamed answer's id: which worker served it (bench.gateways)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.port = str(transport.get_extra_info("sockname")[1]).encode()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            match = re.search(rb"content-length:\s*(\d+)", head)
            length = int(match.group(1)) if match else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            assert self.transport is not None
            parts = head.split(b" ", 2)
            if len(parts) < 2 or head.startswith(b"pri * http/2"):  # an HTTP/2 probe (the Rust router's): not served
                self.transport.close()
                return
            answer = self._answer(parts[1], body)
            if self.delay_s and parts[1].startswith(b"/v1/chat"):  # in order: every answer is as late
                asyncio.get_running_loop().call_later(self.delay_s, self._write, answer)
            else:
                self.transport.write(answer)

    def _write(self, answer: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)

    def _answer(self, path: bytes, body: bytes) -> bytes:
        if path.startswith(b"/v1/chat/completions"):
            tokens = max(1, len(body) // 4)
            if _STREAM_FLAG.search(body[-400:]) or _STREAM_FLAG.search(body[:400]):
                return _response(b"200 OK", _stream(tokens), b"text/event-stream")
            return _response(b"200 OK", _answer(tokens, self.port), b"application/json")
        if path.startswith(b"/metrics"):
            return _response(b"200 OK", _METRICS, b"text/plain")
        if path.startswith(b"/v1/models"):
            return _response(b"200 OK", b'{"object":"list","data":[{"id":"m","object":"model"}]}', b"application/json")
        return _response(b"200 OK", b"{}", b"application/json")  # /health, /version, anything else


async def _serve_fleet(count: int, ports_file: Path, delay_s: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda: _Worker(delay_s), "127.0.0.1", 0, backlog=256) for _ in range(count)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    tmp = ports_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.rename(ports_file)
    await asyncio.Event().wait()


class Fleet:
    """`count` workers served by one child process; stop() ends it."""

    def __init__(self, count: int, delay_ms: float = 0.0) -> None:
        ports_file = Path(tempfile.mkdtemp(prefix="m3gate-fleet-")) / "ports.json"
        self.proc = subprocess.Popen([sys.executable, "-m", "loadtests.bench.scale", "--fleet", str(count),
                                      "--ports-file", str(ports_file), "--fleet-delay-ms", str(delay_ms)])
        deadline = time.monotonic() + 60
        while not ports_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the fleet did not start")
            time.sleep(0.05)
        self.urls = [f"http://127.0.0.1:{p}" for p in json.loads(ports_file.read_text())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


# ---------------------------------------------------------------------------------------------------------------
# Measuring


def scale_config(urls: Sequence[str], max_model_len: int = 8192) -> dict[str, Any]:
    """bench_config (admission never holds a request back) with health checks every 5 s: metrics stay fresh
    (routing trusts them for 10 s) while probing a thousand replicas stays a small, steady cost."""
    cfg = bench_config(urls)
    cfg["server"] = {**cfg.get("server", {}), "health_interval_s": HEALTH_INTERVAL_S}
    cfg["pools"] = [{**cfg["pools"][0], "max_model_len": max_model_len}]
    return cfg


def idle_rate(pids: Sequence[int], seconds: float) -> float:
    """CPU seconds per second the processes spend with no request: health checks, scrapes, timers."""
    c0 = sum(cpu_seconds(p) for p in pids)
    time.sleep(seconds)
    return (sum(cpu_seconds(p) for p in pids) - c0) / seconds


class Proxy:
    """A proxy under test: its URL, its processes (CPU is theirs together), how to stop it, its idle CPU rate."""

    def __init__(self, name: str, url: str, pids: Sequence[int], stop: Any) -> None:
        self.name, self.url, self.pids, self.stop = name, url, tuple(pids), stop
        self.idle = 0.0


def per_request_ms(proxy: Proxy, body: dict[str, Any], seconds: float) -> float | None:
    """One closed-loop segment through the proxy: its CPU per request less its idle CPU, in ms."""
    seg = run_segment([proxy.url], body, CONCURRENCY, seconds, proxy.pids, "scale")
    if not seg.ok or seg.gw_cpu is None or seg.errors:
        print(f"  {proxy.name}: {seg.ok} ok, errors {seg.errors}", flush=True)
        return None
    busy = seg.gw_cpu - proxy.idle * seg.wall
    return busy / seg.ok * 1e3 if busy > 0.0 else None  # under the idle rate: not measurable in this segment


def start_proxies(urls: Sequence[str], peer: str | None, max_model_len: int) -> list[Proxy]:
    gw = GatewayProc(scale_config(urls, max_model_len), timeout=120)
    proxies = [Proxy("m3gate", gw.url, [gw.pid], gw.stop)]
    if peer:
        try:
            p: PeerProcess = start_peer(peer, urls, timeout_s=180)
            proxies.append(Proxy(peer, p.url, p.pids, p.stop))
        except RuntimeError as exc:
            print(f"  {peer} skipped: {str(exc)[:300]}", flush=True)
    return proxies


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def measure_size(n: int, peer: str | None, rounds: int, seconds: float) -> dict[str, dict[str, float | None]]:
    """Per mode (nonstream, stream), per proxy: median ms of CPU per request over the interleaved rounds."""
    fleet = Fleet(n)
    proxies: list[Proxy] = []
    try:
        proxies = start_proxies(fleet.urls, peer, 8192)
        time.sleep(6.0)  # every replica probed once: healthy, scraped
        bodies = {"nonstream": chat_body(16, False), "stream": chat_body(STREAM_TOKENS, True)}
        for p in proxies:  # warm-up: connections to many replicas, caches
            per_request_ms(p, bodies["nonstream"], 0.5)
            p.idle = idle_rate(p.pids, IDLE_S)
        out: dict[str, dict[str, list[float | None]]] = {m: {p.name: [] for p in proxies} for m in bodies}
        for r in range(rounds):
            order = proxies if r % 2 == 0 else proxies[::-1]
            for mode, body in bodies.items():
                for p in order:
                    out[mode][p.name].append(per_request_ms(p, body, seconds))
        result: dict[str, dict[str, float | None]] = {m: {name: _median(v) for name, v in per.items()}
                                                      for m, per in out.items()}
        result["idle"] = {p.name: p.idle for p in proxies}
        return result
    finally:
        for p in proxies:
            p.stop()
        fleet.stop()


_WORDS = ("the agent reads a file from the repository and then calls a tool to run the tests before it writes "
          "its answer about which function should change and why the value returned there is not what the caller "
          "expected when the input is empty").split()


def _long_text(tokens: int, seed: int) -> str:
    """About `tokens` tokens of English-like words (~0.75 of a word per token), different from the first words on for
    each seed."""
    count = len(_WORDS)
    words = (_WORDS[(i * 7 + seed) % count] for i in itertools.count())
    return f"Request {seed}: " + " ".join(itertools.islice(words, tokens * 3 // 4))


def measure_long(n: int, peer: str | None, requests: int) -> dict[int, dict[str, float | None]]:
    """Per prompt size: per proxy, ms of CPU per long request (one at a time, each text new)."""
    fleet = Fleet(n)
    proxies: list[Proxy] = []
    try:
        proxies = start_proxies(fleet.urls, peer, 131_072)
        time.sleep(6.0)
        for p in proxies:
            p.idle = idle_rate(p.pids, IDLE_S)
        out: dict[int, dict[str, float | None]] = {}
        for tokens in LONG_TOKENS:
            bodies = [{**chat_body(16, False), "messages": [{"role": "user", "content": _long_text(tokens, s)}]}
                      for s in range((requests + LONG_WARMUP) * len(proxies))]
            out[tokens] = {}
            for i, p in enumerate(proxies):
                mine = bodies[i * (requests + LONG_WARMUP):(i + 1) * (requests + LONG_WARMUP)]
                _long_cpu(p, mine[:LONG_WARMUP])  # first-use costs (tables, code paths, connections) not counted
                out[tokens][p.name] = _long_cpu(p, mine[LONG_WARMUP:])
        return out
    finally:
        for p in proxies:
            p.stop()
        fleet.stop()


MEMORY_PHASES = ((2_000, 28_000), (200, 400_000))  # (distinct prompts, tokens each)
MEMORY_CONCURRENCY = 8


def _rss_mib(pids: Sequence[int]) -> float:
    import psutil

    return sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20


def _send_all(url: str, count: int, tokens: int, seed: int) -> int:
    """`count` distinct prompts of `tokens` tokens, MEMORY_CONCURRENCY at a time; returns how many answered 200."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    def one(k: int) -> bool:
        body = orjson.dumps({**chat_body(16, False),
                             "messages": [{"role": "user", "content": _long_text(tokens, seed + k)}]})
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                resp.read()
                return resp.status == 200
        except OSError:
            return False

    with ThreadPoolExecutor(MEMORY_CONCURRENCY) as pool:
        return sum(pool.map(one, range(count)))


def measure_memory(n: int, peer: str | None, scale: float) -> dict[str, dict[str, float | None]]:
    """Per proxy (each on a fresh fleet of N): RSS (MiB, its processes together) after warm-up, after
    MEMORY_PHASES' distinct long prompts one phase after the other, and 10 s later; `scale` shrinks the counts."""
    out: dict[str, dict[str, float | None]] = {}
    for name in ("m3gate", *([peer] if peer else [])):
        fleet = Fleet(n)
        proxies: list[Proxy] = []
        try:
            proxies = start_proxies(fleet.urls, peer if name != "m3gate" else None, 1_048_576)
            for other in [p for p in proxies if p.name != name]:  # m3gate starts beside the peer: not measured here
                other.stop()
                proxies.remove(other)
            if not proxies:
                continue
            proxy = proxies[0]
            time.sleep(6.0)
            _send_all(proxy.url, 16, 1_000, 10**7)
            row: dict[str, float | None] = {"warm": _rss_mib(proxy.pids)}
            for count, tokens in MEMORY_PHASES:
                count = max(1, int(count * scale))
                ok = _send_all(proxy.url, count, tokens, tokens)
                row[f"after {count}×{tokens // 1000}K"] = _rss_mib(proxy.pids)
                row[f"answered {count}×{tokens // 1000}K"] = float(ok)
                print(f"  {name}: {ok}/{count} × {tokens:,} tokens, RSS {row[f'after {count}×{tokens // 1000}K']:.0f}"
                      " MiB", flush=True)
            time.sleep(10.0)
            row["settled"] = _rss_mib(proxy.pids)
            out[name] = row
        finally:
            for p in proxies:
                p.stop()
            fleet.stop()
    return out


def _long_cpu(proxy: Proxy, bodies: Sequence[dict[str, Any]]) -> float | None:
    import urllib.request

    payloads = [orjson.dumps(b) for b in bodies]
    c0, t0 = sum(cpu_seconds(p) for p in proxy.pids), time.monotonic()
    for payload in payloads:
        req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=payload,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            if resp.status != 200:
                return None
            resp.read()
    cpu = sum(cpu_seconds(p) for p in proxy.pids) - c0 - proxy.idle * (time.monotonic() - t0)
    return max(0.0, cpu) / len(payloads) * 1e3


# ---------------------------------------------------------------------------------------------------------------
# Report


def _pct(rate: float | None) -> float | None:
    return None if rate is None else rate * 100.0


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def report(sizes: dict[int, dict[str, dict[str, float | None]]], long: dict[int, dict[str, float | None]],
           peer: str | None, long_pool: int) -> str:
    lines = [f"Gateway CPU per request (ms), zero-latency workers, closed loop c={CONCURRENCY}; m3gate ÷ {peer}",
             "", "| mode | N | m3gate | peer | × peer | × m3gate at smallest N |", "|---|---|---|---|---|---|"]
    idle = [f"| idle (% of a core) | {n} | {_fmt(_pct(per['idle'].get('m3gate')), '.1f')} | "
            f"{_fmt(_pct(per['idle'].get(peer)) if peer else None, '.1f')} | | |" for n, per in sorted(sizes.items())]
    first = min(sizes) if sizes else None
    for mode in ("nonstream", "stream"):
        for n, per in sorted(sizes.items()):
            mine = per[mode].get("m3gate")
            theirs = per[mode].get(peer) if peer else None
            base = sizes[first][mode].get("m3gate") if first is not None else None
            ratio = mine / theirs if mine and theirs else None
            growth = mine / base if mine and base else None
            lines.append(f"| {mode} | {n} | {_fmt(mine)} | {_fmt(theirs)} | {_fmt(ratio, '.2f')} | "
                         f"{_fmt(growth, '.2f')} |")
    lines += idle
    if long:
        lines += ["", f"Long prompts at N={long_pool}, one at a time, each text new: CPU per request (ms)", "",
                  "| prompt tokens | m3gate | peer | × peer |", "|---|---|---|---|"]
        for tokens, per in long.items():
            mine, theirs = per.get("m3gate"), per.get(peer) if peer else None
            lines.append(f"| {tokens:,} | {_fmt(mine, '.2f')} | {_fmt(theirs, '.2f')} | "
                         f"{_fmt(mine / theirs if mine and theirs else None, '.2f')} |")
    return "\n".join(lines)


def results_of(sizes: dict[int, dict[str, dict[str, float | None]]], long: dict[int, dict[str, float | None]],
               peer: str | None, args: argparse.Namespace) -> Results:
    """m3gate's CPU per request at each N and for each long prompt, beside the peer's in the same run, and its idle
    CPU: informational (the ratios are what to read), in the one results format."""
    results = Results("scale", vars(args), reference=f"{peer or 'no peer'} in front of the same workers, same run")
    for mode in ("nonstream", "stream"):
        for n, per in sorted(sizes.items()):
            results.add(f"CPU per request, {mode}, N={n}", per[mode].get("m3gate"), "ms", reference=peer,
                        reference_value=per[mode].get(peer) if peer else None)
    for n, per in sorted(sizes.items()):
        results.add(f"idle CPU, N={n}", _pct(per["idle"].get("m3gate")), "%", reference=peer,
                    reference_value=_pct(per["idle"].get(peer)) if peer else None)
    for tokens, per in long.items():
        results.add(f"CPU per request, {tokens:,}-token prompt, N={args.long_pool}", per.get("m3gate"), "ms",
                    reference=peer, reference_value=per.get(peer) if peer else None)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", help="pool sizes, comma-separated (default 16,64,256,1024; --quick: 16,256)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--peer", default="sglang-router:cache_aware", help="'' for none")
    parser.add_argument("--long-pool", type=int, default=100)
    parser.add_argument("--long-requests", type=int, default=24)
    parser.add_argument("--phases", default="sizes,long,memory",
                        help="which to run (default all): sizes (CPU per request at each N), long (long prompts' "
                             "CPU), memory (RSS through 2,000 distinct 28K-token and 200 distinct 400K-token prompts; "
                             "--quick: a quarter of each)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default loadtests/results/<time>-scale/)")
    parser.add_argument("--fleet", type=int, help=argparse.SUPPRESS)  # internal: serve a fleet of this size
    parser.add_argument("--ports-file", help=argparse.SUPPRESS)
    parser.add_argument("--fleet-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    raise_fd_limit(20_000)
    if args.fleet:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_serve_fleet(args.fleet, Path(args.ports_file), args.fleet_delay_ms / 1000))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s] if args.sizes else \
        [16, 256] if args.quick else [16, 64, 256, 1024]
    rounds, seconds = (1, 2.0) if args.quick else (args.rounds, args.seconds)
    peer = args.peer or None
    phases = set(args.phases.split(","))
    results = {}
    for n in (sizes if "sizes" in phases else []):
        print(f"N={n} ...", flush=True)
        results[n] = measure_size(n, peer, rounds, seconds)
        print(f"  {results[n]}", flush=True)
    long: dict[int, dict[str, float | None]] = {}
    if args.long_pool and "long" in phases:
        print(f"long prompts, N={args.long_pool} ...", flush=True)
        long = measure_long(args.long_pool, peer, 8 if args.quick else args.long_requests)
    memory: dict[str, dict[str, float | None]] = {}
    if "memory" in phases:
        print(f"memory, N={args.long_pool} ...", flush=True)
        memory = measure_memory(args.long_pool, peer, 0.25 if args.quick else 1.0)
    text = report(results, long, peer, args.long_pool)
    if memory:
        columns = list(next(iter(memory.values())))
        text += ("\n\nMemory: RSS (MiB) through distinct long prompts, " + f"{MEMORY_CONCURRENCY} at a time\n\n| proxy | " +
                 " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n" +
                 "\n".join(f"| {name} | " + " | ".join(_fmt(row.get(c), ".0f") for c in columns) + " |"
                            for name, row in memory.items()))
    print()
    print(text)
    folder = args.out or run_dir("scale")
    results = results_of(results, long, peer, args)
    for name, row in memory.items():
        for column, value in row.items():
            if not column.startswith("answered"):
                results.add(f"RSS {column}, {name}", value, "MiB")
    results.write(folder)
    (folder / "scale.md").write_text(text + "\n")
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
