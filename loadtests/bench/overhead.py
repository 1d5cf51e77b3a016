"""What the gateway itself costs: a gateway in front of simulated replicas vs the same replicas directly.

    python -m loadtests.bench.overhead [--quick] [--rounds N] [--profile] [--skip-streams] [--peers P,...]
                                       [--modes pinned,unpinned] [--reference-only]

The gateway runs pinned to CPU 0; this process (the load generator) and the simulated replicas share CPU 1
(`os.sched_setaffinity`), so the gateway's CPU time (/proc/PID/stat) is its own. Direct and gateway segments are
interleaved round by round on the same replicas and pooled, because absolute numbers on a shared 2-core machine are
noisy; ratios and CPU-per-request figures measured side by side are what to read.

1. Non-streaming chat (16 tokens) from zero-latency replicas (`--instant`), closed loop at concurrency 1 and 32:
   latency P50/P99 direct and through the gateway, the difference ("added"), and gateway CPU per request →
   requests per gateway CPU-second.
2. Streaming at concurrency 64: (a) paced, replicas decoding one token per 10 ms (like §5b's mock): relayed SSE
   events/s, gateway CPU per event → events per CPU-second, and the ITL the gateway adds (P50/P99); (b) burst, from
   `--instant` replicas (all events of an answer at once): the relay's best case.
3. 5,000 concurrent open streams from replicas decoding one token per second: gateway RSS and CPU while they trickle.
4. Reference segments: m3gate beside the floor proxies (uvicorn, granian ASGI, granian RSGI; loadtests/lib/floor_proxy.py),
   SGLang's Rust router and Envoy + `m3gate epp` (`envoy+epp`, `envoy+epp-none`: the CPU of both processes),
   non-streaming c=1 (the latency each adds to a lone request) and c=32 and streaming c=64 (64 chunks), each proxy's
   CPU per request (median of the rounds), in two placements: `pinned` (proxies on CPU 0, load generator and
   replicas on CPU 1) and `unpinned` (everything free on both cores, as on a busy node). Both by default; `--quick`
   runs pinned only.

Targets (PASS/FAIL with the measured value): added ≤ 1 ms p50 and ≤ 3 ms p99 at c=32; ≥ 2,000 req/s per core;
≥ 20,000 relayed events/s per core; 5,000 open streams under 1 GiB RSS; m3gate's CPU per request ≤ 2× the Rust
router's in each loaded reference segment (c=32, c=64). With --profile (or when a target is missed,
unless --no-profile) the gateway is run again under cProfile and its hot spots are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pstats
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from loadtests.lib.client import Result, _error_code, _send
from loadtests.lib.harness import run_dir
from loadtests.lib.peers import start_peer
from loadtests.lib.replicas import (
    GatewayProc,
    cpu_seconds,
    sched_wait_seconds,
    bench_config,
    pin,
    raise_fd_limit,
    rss_bytes,
    sim_pool,
    wait_gateway_sees,
)
from loadtests.lib.results import Results
from loadtests.lib.workload import Item

MODEL = "MiniMaxAI/MiniMax-M3"
GW_CPU = {0}
STREAM_SIMS = 4  # replicas holding the open streams (each keeps ~1,250 decoding at one token per second)
PACED_RPS = 400  # the open-loop non-streaming test: well below one core's capacity
LOAD_CPU = {1}
GIB = 1024**3


def chat_body(max_tokens: int, stream: bool, words: int = 12) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["hello"] * words)}],
                            "max_tokens": max_tokens, "ignore_eos": True}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


# ---------------------------------------------------------------------------------------------------------------
# Closed-loop segments


class Segment:
    """One timed segment of `concurrency` workers sending back to back."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.latencies: list[float] = []  # non-stream: response time; stream: TTFT
        self.itl: list[float] = []
        self.events = 0
        self.ok = 0
        self.errors: dict[str, int] = {}
        self.wall = 0.0
        self.gw_cpu: float | None = None  # the proxy's processes together
        self.gw_cpu_parts: list[float] = []  # each process's share, in the target's PID order
        self.gw_wait: float | None = None  # time the gateway was runnable but waited for its CPU


async def closed_loop(urls: Sequence[str], body: dict[str, Any], concurrency: int, seconds: float,
                      warmup_s: float = 0.3, label: str = "") -> Segment:
    seg = Segment(label)
    stream = bool(body.get("stream"))
    payload = orjson.dumps(body)
    item = Item(index=0, cls="bench", api="chat", body=body)
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    turn = [0]
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        start = time.perf_counter()
        measure_from = start + warmup_s
        end = measure_from + seconds

        async def worker() -> None:
            while True:
                now = time.perf_counter()
                if now >= end:
                    return
                url = urls[turn[0] % len(urls)]
                turn[0] += 1
                res = Result(item, 0.0)
                await _send(http, url + "/v1/chat/completions", item, payload, res, headers, None)
                if time.perf_counter() < measure_from:
                    continue
                if res.error:
                    seg.errors[res.error] = seg.errors.get(res.error, 0) + 1
                    continue
                seg.ok += 1
                seg.latencies.append(res.ttft if stream else res.e2el)  # type: ignore[arg-type]
                if stream:
                    seg.itl.extend(res.itl)
                    seg.events += res.chunks + 2  # token/role chunks + the usage chunk + [DONE]

        await asyncio.sleep(0)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seg.wall = max(1e-9, time.perf_counter() - measure_from)
    return seg


async def paced_loop(urls: Sequence[str], body: dict[str, Any], rate: float, max_in_flight: int, seconds: float,
                     warmup_s: float = 0.3, label: str = "") -> Segment:
    """Open loop: a request every 1/rate s (at most `max_in_flight` at once), so latency is measured below
    saturation, where it shows the gateway's per-request time rather than its queue."""
    seg = Segment(label)
    payload = orjson.dumps(body)
    item = Item(index=0, cls="bench", api="chat", body=body)
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    sem = asyncio.Semaphore(max_in_flight)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        start = time.perf_counter()
        measure_from = start + warmup_s
        end = measure_from + seconds
        tasks = []

        async def one(url: str) -> None:
            async with sem:
                res = Result(item, 0.0)
                await _send(http, url + "/v1/chat/completions", item, payload, res, headers, None)
            if time.perf_counter() < measure_from:
                return
            if res.error:
                seg.errors[res.error] = seg.errors.get(res.error, 0) + 1
                return
            seg.ok += 1
            seg.latencies.append(res.e2el or 0.0)

        k = 0
        while True:
            at = start + k / rate
            now = time.perf_counter()
            if at >= end:
                break
            if at > now:
                await asyncio.sleep(at - now)
            tasks.append(asyncio.ensure_future(one(urls[k % len(urls)])))
            k += 1
        await asyncio.gather(*tasks)
        seg.wall = max(1e-9, time.perf_counter() - measure_from)
    return seg


def run_segment(urls: Sequence[str], body: dict[str, Any], concurrency: int, seconds: float, pids: Sequence[int],
                label: str, rate: float | None = None) -> Segment:
    """A segment, with the CPU time (and run-queue wait) of the proxy's processes `pids` (none: not measured)
    measured around it, warm-up excluded."""
    async def go() -> Segment:
        if rate:
            task = asyncio.ensure_future(paced_loop(urls, body, rate, concurrency, seconds, label=label))
        else:
            task = asyncio.ensure_future(closed_loop(urls, body, concurrency, seconds, label=label))
        await asyncio.sleep(0.3)
        c0 = [cpu_seconds(pid) for pid in pids]
        w0 = sum(sched_wait_seconds(pid) for pid in pids)
        seg = await task
        if pids:
            seg.gw_cpu_parts = [cpu_seconds(pid) - c for pid, c in zip(pids, c0, strict=True)]
            seg.gw_cpu = sum(seg.gw_cpu_parts)
            seg.gw_wait = sum(sched_wait_seconds(pid) for pid in pids) - w0
        return seg

    return asyncio.run(go())


def pct(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000, p)) if values else None


Targets = dict[str, tuple[Sequence[str], tuple[int, ...]]]  # name → (urls, the PIDs of the proxy measured)


def interleaved_targets(targets: Targets, body: dict[str, Any], concurrency: int, seconds: float, rounds: int,
                        label: str, rate: float | None = None) -> dict[str, dict[str, Any]]:
    """Segments on each target (name → (urls, PIDs of the proxy whose CPU is measured, none for the replicas)), the
    order alternating round by round; per target, percentiles over the pooled samples and, with PIDs, their CPU
    together (and each process's share, where there are several)."""
    segs: dict[str, list[Segment]] = {name: [] for name in targets}
    for urls, _ in targets.values():  # warm-up, discarded: connection pools, caches, first scrapes
        run_segment(urls, body, concurrency, 1.0, (), f"{label} warm-up")
    order = list(targets)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            urls, pids = targets[name]
            segs[name].append(run_segment(urls, body, concurrency, seconds, pids, f"{label} {name}", rate))
    out: dict[str, dict[str, Any]] = {}
    for name, ss in segs.items():
        lat = [x for s in ss for x in s.latencies]
        itl = [x for s in ss for x in s.itl]
        ok = sum(s.ok for s in ss)
        wall = sum(s.wall for s in ss)
        events = sum(s.events for s in ss)
        errors: dict[str, int] = {}
        for s in ss:
            for k, v in s.errors.items():
                errors[k] = errors.get(k, 0) + v
        t = out[name] = {"requests": ok, "rps": ok / wall, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
                         "mean_ms": 1000 * statistics.mean(lat) if lat else None, "errors": errors,
                         "events": events, "events_per_s": events / wall,
                         "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
                         "per_round_rps": [s.ok / s.wall for s in ss]}
        if targets[name][1]:
            cpu = sum(s.gw_cpu or 0.0 for s in ss)
            if len(targets[name][1]) > 1:
                parts = [sum(s.gw_cpu_parts[i] for s in ss) for i in range(len(targets[name][1]))]
                t["cpu_ms_per_req_by_process"] = [1000 * c / ok if ok else None for c in parts]
            t["gw_cpu_s"] = cpu
            t["gw_cpu_share"] = cpu / wall  # of one core
            t["gw_runqueue_wait_share"] = sum(s.gw_wait or 0.0 for s in ss) / wall
            t["gw_cpu_ms_per_req"] = 1000 * cpu / ok if ok else None
            t["req_per_cpu_s"] = ok / cpu if cpu else None
            t["gw_cpu_us_per_event"] = 1e6 * cpu / events if events else None
            t["events_per_cpu_s"] = events / cpu if cpu and events else None
            t["per_round_cpu_ms_per_req"] = [1000 * (s.gw_cpu or 0.0) / s.ok if s.ok else None for s in ss]
            per_round = [x for x in t["per_round_cpu_ms_per_req"] if x is not None]
            t["cpu_ms_per_req_median"] = statistics.median(per_round) if per_round else None
    return out


def _added(target: dict[str, Any], direct: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """`added_<key>` (target − direct) for each key, and the throughput ratio."""
    out: dict[str, Any] = {f"added_{key}": target[key] - direct[key]
                           if target[key] is not None and direct[key] is not None else None for key in keys}
    out["rps_ratio"] = target["rps"] / direct["rps"] if direct["rps"] else None
    return out


def interleaved(direct_urls: Sequence[str], gw_url: str, gw_pid: int, body: dict[str, Any], concurrency: int,
                seconds: float, rounds: int, label: str, rate: float | None = None) -> dict[str, Any]:
    """Direct and gateway segments alternated `rounds` times; percentiles over the pooled samples."""
    res = interleaved_targets({"direct": (direct_urls, ()), "gateway": ([gw_url], (gw_pid,))}, body, concurrency,
                              seconds, rounds, label, rate)
    out: dict[str, Any] = {"concurrency": concurrency, "rounds": rounds, "seconds": seconds, "rate": rate, **res}
    out.update(_added(res["gateway"], res["direct"], ("p50_ms", "p99_ms", "itl_p50_ms", "itl_p99_ms")))
    return out


MODES = ("pinned", "unpinned")
# c=1: the latency a proxy adds to one request at a time (no queueing); c=32 / c=64: its CPU per request under load
REFERENCE_KINDS = (("nonstream_c1", "non-stream c=1", False, 1), ("nonstream_c32", "non-stream c=32", False, 32),
                   ("stream_c64", "stream c=64 (64 chunks)", True, 64))


def place(mode: str, proxies: Sequence[int], load: Sequence[int]) -> None:
    """`pinned`: proxies (gateway, peers) on GW_CPU, this process and the replicas on LOAD_CPU. `unpinned`: all of
    them free on every core, as on a busy node where the gateway shares its cores with what it talks to."""
    every = set(range(os.cpu_count() or 1))
    for pid in proxies:
        pin(pid, GW_CPU if mode == "pinned" else every)
    for pid in (os.getpid(), *load):
        pin(pid, LOAD_CPU if mode == "pinned" else every)


def reference(direct_urls: Sequence[str], sim_pids: Sequence[int], gw_url: str, gw_pid: int, seconds: float,
              rounds: int, peers: Sequence[str], modes: Sequence[str] = ("pinned",)) -> dict[str, Any]:
    """m3gate and reference proxies (loadtests.lib.peers) side by side, interleaved with direct segments, in each mode
    (`place`): non-streaming c=32 and streaming c=64 (64-token answers from `--instant` replicas: the relay's
    per-chunk cost). What any proxy costs on this machine vs what m3gate costs, measured in the same run."""
    started: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for name in peers:
        try:
            started[name] = start_peer(name, direct_urls)
        except RuntimeError as exc:
            notes[name] = str(exc).splitlines()[0][:200]
    targets: Targets = {"direct": (direct_urls, ()), "m3gate": ([gw_url], (gw_pid,))}
    targets.update({name: ([peer.url], peer.pids) for name, peer in started.items()})
    proxies = [gw_pid, *(pid for peer in started.values() for pid in peer.pids)]
    out: dict[str, Any] = {"notes": notes, "modes": {}}
    try:
        for mode in modes:
            place(mode, proxies, sim_pids)
            out["modes"][mode] = {}
            for key, label, stream, conc in REFERENCE_KINDS:
                res = interleaved_targets(targets, chat_body(64 if stream else 16, stream), conc, seconds, rounds,
                                          f"reference {mode} {label}")
                for t in res.values():
                    t.update(_added(t, res["direct"], ("p50_ms", "p99_ms")))
                out["modes"][mode][key] = res
                for name, t in res.items():
                    print(f"  reference {mode:<8s} {label:<23s} {name:<18s} p50 {_f(t['p50_ms'])} ms "
                          f"(+{_f(t['added_p50_ms'])})  p99 {_f(t['p99_ms'])} ms (+{_f(t['added_p99_ms'])})  rps "
                          f"{t['rps']:.0f}  CPU {_f(t.get('cpu_ms_per_req_median'), '.3f')} ms/req{_parts(t)} "
                          f"(rounds {', '.join(_f(x, '.3f') for x in t.get('per_round_cpu_ms_per_req', []))})",
                          flush=True)
    finally:
        place("pinned", [gw_pid], sim_pids)
        for peer in started.values():
            peer.stop()
    for name, why in notes.items():
        print(f"  reference {name}: skipped ({why})", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# 5,000 open streams


async def _open_streams(url: str, n: int, body: dict[str, Any], ramp_per_s: float, gw_pid: int, hold_s: float,
                        timeout_s: float) -> dict[str, Any]:
    payload = orjson.dumps(body)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    first_chunk = 0
    errors: dict[str, int] = {}
    opened = asyncio.Event()

    async def one(http: aiohttp.ClientSession) -> None:
        nonlocal first_chunk
        try:
            async with http.post(url + "/v1/chat/completions", data=payload,
                                 headers={"content-type": "application/json"}) as resp:
                if resp.status != 200:
                    key = f"http_{resp.status}{_error_code(await resp.read())}"
                    errors[key] = errors.get(key, 0) + 1
                    return
                got = False
                async for _chunk in resp.content.iter_any():
                    if not got:
                        got = True
                        first_chunk += 1
                        if first_chunk >= n:
                            opened.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - counted
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    rss0 = rss_bytes(gw_pid)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None,
                                                                                         sock_connect=30)) as http:
        tasks = []
        t0 = time.perf_counter()
        for k in range(n):
            tasks.append(asyncio.ensure_future(one(http)))
            if ramp_per_s and k % 100 == 99:
                delay = t0 + (k + 1) / ramp_per_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
        try:
            await asyncio.wait_for(opened.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass
        t_open = time.perf_counter() - t0
        open_now = first_chunk
        c0, w0 = cpu_seconds(gw_pid), time.perf_counter()
        rss_peak = rss_bytes(gw_pid)
        end = w0 + hold_s
        while time.perf_counter() < end:
            await asyncio.sleep(0.5)
            rss_peak = max(rss_peak, rss_bytes(gw_pid))
        cpu_share = (cpu_seconds(gw_pid) - c0) / (time.perf_counter() - w0)
        still_open = sum(1 for t in tasks if not t.done())
        rss = rss_bytes(gw_pid)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)
    return {"streams": n, "opened": open_now, "still_open_at_end": still_open, "seconds_to_open": t_open,
            "gw_rss_before_mib": rss0 / 2**20, "gw_rss_mib": rss / 2**20, "gw_rss_peak_mib": rss_peak / 2**20,
            "gw_rss_per_stream_kib": (rss_peak - rss0) / 1024 / max(1, open_now), "gw_cpu_share": cpu_share,
            "gw_rss_after_close_mib": rss_bytes(gw_pid) / 2**20, "errors": errors}


# ---------------------------------------------------------------------------------------------------------------
# Gateway processes (plain, or under cProfile)


def serve_profiled(config_path: str, port: int, out: str) -> int:
    """Run the gateway in this process under cProfile; write the stats when it exits (SIGTERM)."""
    import cProfile

    from gateway.server import serve

    prof = cProfile.Profile(time.process_time)  # CPU time: a shared core's waits are not the gateway's cost
    done = [False]

    def dump(*_: Any) -> None:
        if not done[0]:
            done[0] = True
            prof.disable()
            prof.dump_stats(out)

    def on_term(signum: int, frame: Any) -> None:  # uvicorn re-raises the signal it caught after shutting down
        dump()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())  # the bench starts profiling after start-up + warm-up
    try:
        return serve(config_path, "127.0.0.1", port)
    finally:
        dump()


COMPONENTS = (  # (label, file basename, function): where a request's gateway CPU goes
    ("whole request in uvicorn (run_asgi)", "httptools_impl.py", "run_asgi"),
    ("Coordinator.serve (handler)", "coordinator.py", "serve"),
    ("classify", "classify.py", "classify"),
    ("pool choice", "coordinator.py", "choose_pool"),
    ("prefix hashing (prefix_blocks)", "prefix.py", "prefix_blocks"),
    ("replica choice (policy.choose)", "replica_choice.py", "choose"),
    ("admission (admit)", "admission.py", "admit"),
    ("forward (upstream call and answer)", "coordinator.py", "forward"),
    ("  aiohttp client request", "client.py", "_request"),
    ("  disconnect watchers (call_or_disconnect)", "relay.py", "call_or_disconnect"),
    ("stream pump (StreamRelay._pump)", "relay.py", "_pump"),
    ("  SSE filter (SseFilter.feed)", "relay.py", "feed"),
    ("  usage parsing (SseFilter._take_usage)", "relay.py", "_take_usage"),
    ("  aiohttp stream reads (readany)", "streams.py", "readany"),
    ("  uvicorn send", "httptools_impl.py", "send"),
    ("telemetry.finish (metrics)", "telemetry.py", "finish"),
)


def component_breakdown(path: Path, requests: int) -> list[dict[str, Any]]:
    """CPU per request (profiled: inflated by cProfile, so compare shares) of the parts of a request."""
    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for label, file, func in COMPONENTS:
        cum = sum(v[3] for (f, _line, name), v in stats.stats.items()  # type: ignore[attr-defined]
                  if name == func and os.path.basename(f) == file)
        if cum:
            rows.append({"part": label, "us_per_req": 1e6 * cum / max(1, requests), "share": cum / total})
    rows.append({"part": "all gateway CPU while profiled", "us_per_req": 1e6 * total / max(1, requests),
                 "share": 1.0})
    return rows


def hot_spots(path: Path, top: int = 30) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(str(path), stream=buf)
    buf.write("CPU seconds (time.process_time); 'tottime' = in the function itself, 'cumtime' = with callees\n")
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    buf.write("\n---- by cumulative time ----\n")
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def profile_gateway(folder: Path, seconds: float) -> dict[str, Any]:
    """cProfile (CPU time) of a gateway under non-streaming c=32 and streaming c=64 load, from zero-latency replicas
    and from replicas pacing tokens 10 ms apart; returns the hot-spot tables (also written next to the .prof files)."""
    out: dict[str, Any] = {}
    cases = (
        ("nonstream_c32", ["--instant", "--max-num-seqs", "1024"], chat_body(16, False), 32),
        ("stream_paced_c64", ["--decode-ms-per-step", "10", "--decode-ms-per-seq", "0", "--prefill-us-per-token", "0",
                              "--max-num-seqs", "1024"], chat_body(64, True), 64),
        ("stream_burst_c64", ["--instant", "--max-num-seqs", "1024"], chat_body(64, True), 64),
    )
    for name, sim_args, body, conc in cases:
        prof = folder / f"gateway-{name}.prof"
        with sim_pool(2, 8192, sim_args) as pool:
            gw = GatewayProc(bench_config(pool.urls),
                             serve_module=("loadtests.bench.overhead", "--serve-profiled", str(prof)), cpus=GW_CPU)
            try:
                wait_gateway_sees(gw.url, len(pool.urls))
                run_segment([gw.url], body, conc, 0.5, (), "warm-up")
                os.kill(gw.pid, signal.SIGUSR1)
                seg = run_segment([gw.url], body, conc, seconds, (gw.pid,), f"profile {name}")
            finally:
                gw.stop()
        text = hot_spots(prof) if prof.exists() else "(no profile written)"
        (folder / f"gateway-{name}.txt").write_text(text)
        out[name] = {"requests": seg.ok, "rps_under_profiler": seg.ok / seg.wall, "table": text, "file": str(prof),
                     "gw_cpu_ms_per_req_profiled": 1000 * (seg.gw_cpu or 0) / seg.ok if seg.ok else None,
                     "breakdown": component_breakdown(prof, seg.ok) if prof.exists() else []}
    return out


# ---------------------------------------------------------------------------------------------------------------


def gateway_metric_overhead(url: str) -> float | None:
    """Mean of the gateway's own m3gate_gateway_overhead_seconds (its pre-upstream work per request), if exported."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("m3gate_gateway_overhead_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("m3gate_gateway_overhead_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return 1000 * total / count if count else None


def _f(v: Any, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def _parts(t: dict[str, Any]) -> str:
    """A several-process proxy's CPU per request, process by process (envoy+epp: the picker, then Envoy)."""
    parts = t.get("cpu_ms_per_req_by_process")
    return f" [{' + '.join(_f(x, '.3f') for x in parts)}]" if parts else ""


def run(quick: bool, rounds: int, profile: bool | None, skip_streams: bool, folder: Path,
        open_streams: int, peers: Sequence[str] = ("floor", "sglang-router"), modes: Sequence[str] = MODES,
        reference_only: bool = False) -> dict[str, Any]:
    if reference_only:
        skip_streams, profile = True, False
    fd = raise_fd_limit(20000)
    cpus = os.sched_getaffinity(0)
    pinned = len(cpus | set(range(os.cpu_count() or 1))) >= 2 and pin(os.getpid(), LOAD_CPU)
    seg_s = 2.0 if quick else 5.0
    result: dict[str, Any] = {"quick": quick, "rounds": rounds, "fd_limit": fd, "pinned": pinned, "modes": list(modes),
                              "cpus": sorted(os.sched_getaffinity(0)), "machine_cpus": os.cpu_count(),
                              "loadavg_start": os.getloadavg()}
    print(f"overhead bench: gateway on CPU {sorted(GW_CPU)}, load generator + replicas on CPU {sorted(LOAD_CPU)} "
          f"({'pinned' if pinned else 'NOT pinned'}); load average {os.getloadavg()[0]:.1f}", flush=True)
    instant_args = ["--instant", "--max-num-seqs", "1024"]
    with sim_pool(2, 8192, instant_args) as pool:
        cfg = bench_config(pool.urls)
        result["gateway_config"] = cfg
        gw = GatewayProc(cfg, cpus=GW_CPU)
        try:
            wait_gateway_sees(gw.url, 2)
            if not reference_only:
                for conc in (1, 32):
                    r = interleaved(pool.urls, gw.url, gw.pid, chat_body(16, False), conc, seg_s, rounds,
                                    f"non-stream c={conc}")
                    result[f"nonstream_c{conc}"] = r
                    d, g = r["direct"], r["gateway"]
                    print(f"  non-stream c={conc:<3d} p50 {_f(d['p50_ms'])} → {_f(g['p50_ms'])} ms "
                          f"(+{_f(r['added_p50_ms'])})  p99 {_f(d['p99_ms'])} → {_f(g['p99_ms'])} ms "
                          f"(+{_f(r['added_p99_ms'])})  rps {d['rps']:.0f} → "
                          f"{g['rps']:.0f}  gw CPU {_f(g['gw_cpu_ms_per_req'], '.3f')} ms/req "
                          f"({_f(g['req_per_cpu_s'], '.0f')} req/CPU-s, {g['gw_cpu_share']:.0%} of a core, waited for "
                          f"its core {g['gw_runqueue_wait_share']:.0%})", flush=True)
                r = interleaved(pool.urls, gw.url, gw.pid, chat_body(16, False), 32, seg_s, rounds, "non-stream paced",
                                rate=PACED_RPS)
                result["nonstream_paced"] = r
                d, g = r["direct"], r["gateway"]
                print(f"  non-stream {PACED_RPS}/s open loop (≤ 32 in flight) p50 {_f(d['p50_ms'])} → {_f(g['p50_ms'])} ms "
                      f"(+{_f(r['added_p50_ms'])})  p99 {_f(d['p99_ms'])} → {_f(g['p99_ms'])} ms (+{_f(r['added_p99_ms'])})"
                      f"  gw CPU {_f(g['gw_cpu_ms_per_req'], '.3f')} ms/req", flush=True)
            if peers or modes:
                result["reference"] = reference(pool.urls, pool.pids(), gw.url, gw.pid, seg_s, rounds, peers, modes)
            if not skip_streams:
                r = interleaved(pool.urls, gw.url, gw.pid, chat_body(64, True), 64, seg_s, rounds, "stream burst")
                result["stream_burst_c64"] = r
                g = r["gateway"]
                print(f"  stream burst c=64: {g['events_per_s']:.0f} events/s relayed, gw "
                      f"{_f(g['gw_cpu_us_per_event'], '.1f')} µs/event → {_f(g['events_per_cpu_s'], '.0f')} "
                      f"events/CPU-s", flush=True)
            result["gateway_reported_overhead_ms"] = gateway_metric_overhead(gw.url)
            result["gw_rss_mib_after_nonstream"] = rss_bytes(gw.pid) / 2**20
        finally:
            gw.stop()
    if not skip_streams:
        paced = ["--decode-ms-per-step", "10", "--decode-ms-per-seq", "0", "--prefill-us-per-token", "0",
                 "--max-num-seqs", "1024"]
        with sim_pool(2, 8192, paced) as pool:
            cfg = bench_config(pool.urls)
            gw = GatewayProc(cfg, cpus=GW_CPU)
            try:
                wait_gateway_sees(gw.url, 2)
                r = interleaved(pool.urls, gw.url, gw.pid, chat_body(64, True), 64, seg_s + 1.5, rounds,
                                "stream paced")
                result["stream_paced_c64"] = r
                d, g = r["direct"], r["gateway"]
                print(f"  stream paced c=64 (10 ms/token): {g['events_per_s']:.0f} events/s relayed "
                      f"(direct {d['events_per_s']:.0f}), gw {_f(g['gw_cpu_us_per_event'], '.1f')} µs/event → "
                      f"{_f(g['events_per_cpu_s'], '.0f')} events/CPU-s; ITL p50 {_f(d['itl_p50_ms'])} → "
                      f"{_f(g['itl_p50_ms'])} ms, p99 {_f(d['itl_p99_ms'])} → {_f(g['itl_p99_ms'])} ms; TTFT p50 "
                      f"{_f(d['p50_ms'])} → {_f(g['p50_ms'])} ms", flush=True)
            finally:
                gw.stop()
        slow = ["--decode-ms-per-step", "1000", "--decode-ms-per-seq", "0", "--prefill-us-per-token", "0",
                "--max-num-seqs", str(open_streams), "--kv-blocks", str(max(32768, open_streams * 3))]
        with sim_pool(STREAM_SIMS, 8192, slow) as pool:
            cfg = bench_config(pool.urls)
            gw = GatewayProc(cfg, cpus=GW_CPU)
            try:
                wait_gateway_sees(gw.url, STREAM_SIMS)
                r = asyncio.run(_open_streams(gw.url, open_streams, chat_body(4000, True, words=4), 1000.0, gw.pid,
                                              hold_s=5.0 if quick else 10.0, timeout_s=60.0))
                result["open_streams"] = r
                print(f"  {r['opened']}/{open_streams} streams open in {r['seconds_to_open']:.1f} s; gateway RSS "
                      f"{r['gw_rss_before_mib']:.0f} → {r['gw_rss_peak_mib']:.0f} MiB "
                      f"({r['gw_rss_per_stream_kib']:.1f} KiB/stream), CPU {r['gw_cpu_share']:.0%} of a core while "
                      f"they trickle (1 token/s each); errors {r['errors'] or 'none'}", flush=True)
            finally:
                gw.stop()
    result["checks"] = checks(result, open_streams)
    failed = [c for c in result["checks"] if not c["ok"]]
    if profile or (profile is None and failed):
        print("profiling the gateway under cProfile ...", flush=True)
        result["profile"] = profile_gateway(folder, seg_s + 1.5)
    result["loadavg_end"] = os.getloadavg()
    return result


def checks(r: dict[str, Any], open_streams: int) -> list[dict[str, Any]]:
    out = []
    c32 = r.get("nonstream_c32", {})
    if c32:
        a50, a99 = c32.get("added_p50_ms"), c32.get("added_p99_ms")
        out.append({"name": "added latency p50 ≤ 1 ms at c=32 (non-stream)", "value": f"{_f(a50)} ms",
                    "ok": a50 is not None and a50 <= 1.0})
        out.append({"name": "added latency p99 ≤ 3 ms at c=32 (non-stream)", "value": f"{_f(a99)} ms",
                    "ok": a99 is not None and a99 <= 3.0})
    ref = r.get("reference") or {}
    for mode, kinds in (ref.get("modes") or {}).items():
        for key, label, _stream, conc in REFERENCE_KINDS:
            res = kinds.get(key) or {}
            for name, t in res.items():
                if name in ("direct", "m3gate"):
                    continue
                out.append({"name": f"{label}, {mode}, through {name}, same run (informational)",
                            "value": f"added p50 +{_f(t['added_p50_ms'])} ms, p99 +{_f(t['added_p99_ms'])} ms, "
                                     f"{_f(t.get('cpu_ms_per_req_median'), '.3f')} ms CPU/req", "ok": True})
            mine = (res.get("m3gate") or {}).get("cpu_ms_per_req_median")
            rust = (res.get("sglang-router") or {}).get("cpu_ms_per_req_median")
            if mine and rust and conc > 1:  # the target is about load; at c=1 idle wake-ups dominate
                out.append({"name": f"m3gate CPU per request ≤ 2× the Rust SGLang router's ({label}, {mode}; "
                                    "median of rounds)",
                            "value": f"{mine / rust:.2f}× ({mine:.3f} vs {rust:.3f} ms)", "ok": mine <= 2 * rust})
    paced = r.get("nonstream_paced")
    if paced:
        out.append({"name": f"added latency at {paced['rate']:.0f} req/s open loop, ≤ 32 in flight (informational)",
                    "value": f"p50 {_f(paced['added_p50_ms'])} ms, p99 {_f(paced['added_p99_ms'])} ms", "ok": True})
    g = c32.get("gateway", {})
    rpc = g.get("req_per_cpu_s")
    if c32:
        out.append({"name": "≥ 2,000 req/s per gateway core (non-stream, c=32)",
                    "value": f"{_f(rpc, '.0f')} req/CPU-s ({_f(g.get('gw_cpu_ms_per_req'), '.3f')} ms CPU/req)",
                    "ok": rpc is not None and rpc >= 2000})
    if "stream_paced_c64" in r:
        ep = r["stream_paced_c64"]["gateway"].get("events_per_cpu_s")
        eb = r.get("stream_burst_c64", {}).get("gateway", {}).get("events_per_cpu_s")
        out.append({"name": "≥ 20,000 relayed SSE events/s per gateway core (paced, c=64)",
                    "value": f"{_f(ep, '.0f')} events/CPU-s paced ({_f(1e6 / ep if ep else None, '.1f')} µs/event); "
                             f"burst {_f(eb, '.0f')}",
                    "ok": ep is not None and ep >= 20000})
        itl = r["stream_paced_c64"].get("added_itl_p50_ms"), r["stream_paced_c64"].get("added_itl_p99_ms")
        out.append({"name": "ITL added by the gateway (paced, c=64; informational)",
                    "value": f"p50 {_f(itl[0])} ms, p99 {_f(itl[1])} ms", "ok": True})
    if "open_streams" in r:
        o = r["open_streams"]
        out.append({"name": f"{open_streams:,} concurrent open streams under 1 GiB gateway RSS",
                    "value": f"{o['opened']} open, peak RSS {o['gw_rss_peak_mib']:.0f} MiB, CPU "
                             f"{o['gw_cpu_share']:.0%} of a core",
                    "ok": o["opened"] >= open_streams and o["gw_rss_peak_mib"] * 2**20 < GIB})
    return out


def summary_text(r: dict[str, Any]) -> str:
    lines = ["## Gateway overhead (gateway pinned to CPU 0; load generator + simulated replicas on CPU 1)", "",
             "| test | direct | via gateway | added / ratio | gateway CPU |", "|---|---|---|---|---|"]
    for conc in (1, 32):
        x = r.get(f"nonstream_c{conc}")
        if not x:
            continue
        d, g = x["direct"], x["gateway"]
        lines.append(f"| non-stream c={conc} p50 / p99 ms | {_f(d['p50_ms'])} / {_f(d['p99_ms'])} | "
                     f"{_f(g['p50_ms'])} / {_f(g['p99_ms'])} | +{_f(x['added_p50_ms'])} / +{_f(x['added_p99_ms'])} | "
                     f"{_f(g['gw_cpu_ms_per_req'], '.3f')} ms/req |")
        lines.append(f"| non-stream c={conc} req/s | {d['rps']:.0f} | {g['rps']:.0f} | ×{_f(x['rps_ratio'])} | "
                     f"{g['gw_cpu_share']:.0%} of a core → {_f(g['req_per_cpu_s'], '.0f')} req/CPU-s |")
    x = r.get("nonstream_paced")
    if x:
        d, g = x["direct"], x["gateway"]
        lines.append(f"| non-stream {x['rate']:.0f}/s open loop p50 / p99 ms | {_f(d['p50_ms'])} / {_f(d['p99_ms'])} | "
                     f"{_f(g['p50_ms'])} / {_f(g['p99_ms'])} | +{_f(x['added_p50_ms'])} / +{_f(x['added_p99_ms'])} | "
                     f"{_f(g['gw_cpu_ms_per_req'], '.3f')} ms/req |")
    for key, name in (("stream_burst_c64", "stream burst c=64"), ("stream_paced_c64", "stream paced 10 ms c=64")):
        x = r.get(key)
        if not x:
            continue
        d, g = x["direct"], x["gateway"]
        lines.append(f"| {name} events/s | {d['events_per_s']:.0f} | {g['events_per_s']:.0f} | ×"
                     f"{_f(g['events_per_s'] / d['events_per_s'] if d['events_per_s'] else None)} | "
                     f"{_f(g['gw_cpu_us_per_event'], '.1f')} µs/event → {_f(g['events_per_cpu_s'], '.0f')} ev/CPU-s |")
        lines.append(f"| {name} TTFT p50 / p99 ms | {_f(d['p50_ms'])} / {_f(d['p99_ms'])} | {_f(g['p50_ms'])} / "
                     f"{_f(g['p99_ms'])} | +{_f(x['added_p50_ms'])} / +{_f(x['added_p99_ms'])} | |")
        if key == "stream_paced_c64":
            lines.append(f"| {name} ITL p50 / p99 ms | {_f(d['itl_p50_ms'])} / {_f(d['itl_p99_ms'])} | "
                         f"{_f(g['itl_p50_ms'])} / {_f(g['itl_p99_ms'])} | +{_f(x['added_itl_p50_ms'])} / "
                         f"+{_f(x['added_itl_p99_ms'])} | |")
    o = r.get("open_streams")
    if o:
        lines.append(f"| {o['streams']} open streams | | {o['opened']} open in {o['seconds_to_open']:.1f} s | | RSS "
                     f"{o['gw_rss_before_mib']:.0f} → {o['gw_rss_peak_mib']:.0f} MiB ({o['gw_rss_per_stream_kib']:.1f} "
                     f"KiB/stream), {o['gw_cpu_share']:.0%} CPU |")
    ref = r.get("reference")
    if ref:
        lines += ["", ("Reference proxies in the same run, interleaved with direct segments (CPU: median of the rounds' "
                       "CPU per request, rounds in brackets; pinned = proxies on CPU 0, load generator and replicas "
                       "on CPU 1; unpinned = everything free on both cores):"), "",
                  "| mode | test | proxy | req/s (× direct) | added p50 / p99 ms | proxy CPU ms/req | × Rust router |",
                  "|---|---|---|---|---|---|---|"]
        for mode, kinds in ref["modes"].items():
            for key, label, _stream, _conc in REFERENCE_KINDS:
                res = kinds.get(key) or {}
                rust = (res.get("sglang-router") or {}).get("cpu_ms_per_req_median")
                for name, t in res.items():
                    cpu = t.get("cpu_ms_per_req_median")
                    rounds_ = ", ".join(_f(x, ".3f") for x in t.get("per_round_cpu_ms_per_req", []))
                    lines.append(f"| {mode} | {label} | {name} | {t['rps']:.0f} (×{_f(t['rps_ratio'])}) | "
                                 f"+{_f(t['added_p50_ms'])} / +{_f(t['added_p99_ms'])} | "
                                 f"{_f(cpu, '.3f')}{_parts(t)}{f' ({rounds_})' if rounds_ else ''} | "
                                 f"{_f(cpu / rust if cpu and rust else None)} |")
        for name, why in ref["notes"].items():
            lines.append(f"\n{name}: skipped ({why})")
    c32 = (r.get("nonstream_c32") or {}).get("gateway") or {}
    if c32:
        lines.append(f"\nDuring non-stream c=32 the gateway used {c32['gw_cpu_share']:.0%} of its core and waited "
                     f"{c32['gw_runqueue_wait_share']:.0%} of the time for it (other processes on the shared core): "
                     f"its "
                     f"throughput and queueing there measure the machine as much as the gateway; the CPU per request "
                     f"does not. Load average {r['loadavg_start'][0]:.1f} at the start, {r['loadavg_end'][0]:.1f} at "
                     f"the end.")
    if r.get("gateway_reported_overhead_ms") is not None:
        lines.append(f"\nThe gateway's own m3gate_gateway_overhead_seconds (body read → upstream call) averaged "
                     f"{r['gateway_reported_overhead_ms']:.3f} ms.")
    lines.append("")
    for c in r["checks"]:
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['value']}")
    if "profile" in r:
        lines.append("\nHot spots (cProfile, tottime; full tables in the results folder):")
        for name, p in r["profile"].items():
            lines.append(f"\n### {name} ({p['requests']} requests profiled)\n")
            lines.append("| part of a request | CPU µs/request (under cProfile) | share of gateway CPU |")
            lines.append("|---|---|---|")
            for row in p.get("breakdown", []):
                lines.append(f"| {row['part']} | {row['us_per_req']:.0f} | {row['share']:.0%} |")
            table = p["table"].split("---- by cumulative time ----")[0]
            rows = [ln for ln in table.splitlines() if ln.strip()][3:28]
            lines.append("\nTop functions by own CPU time:\n```\n" + "\n".join(rows) + "\n```")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--serve-profiled":
        return serve_profiled(argv[1], int(argv[2]), argv[3])
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short segments (for make bench)")
    parser.add_argument("--rounds", type=int, help="direct/gateway alternations per test (default 1 quick, 4 full)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                        help="profile the gateway with cProfile (default: only when a target is missed)")
    parser.add_argument("--skip-streams", action="store_true", help="non-streaming tests only")
    parser.add_argument("--open-streams", type=int, default=5000)
    parser.add_argument("--peers", help="reference proxies measured beside m3gate (comma-separated: floor, "
                                        "floor-granian, floor-granian-rsgi, sglang-router, envoy+epp, "
                                        "envoy+epp-none, m3gate@DIR, m3gate-granian@DIR; '' for none; default "
                                        "floor, floor-granian, floor-granian-rsgi, the router and both envoy+epp; "
                                        "without the granian floors with --quick)")
    parser.add_argument("--modes", help="placements for the reference segments (comma-separated: pinned, unpinned; "
                                        "default both, pinned only with --quick)")
    parser.add_argument("--reference-only", action="store_true",
                        help="only the reference segments (m3gate beside the peers), for A/B runs")
    parser.add_argument("--out", help="results folder")
    args = parser.parse_args(argv)
    folder = Path(args.out) if args.out else run_dir("overhead")
    folder.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (1 if args.quick else 4)
    if args.peers is None:
        args.peers = ",".join(["floor", *([] if args.quick else ["floor-granian", "floor-granian-rsgi"]),
                               "sglang-router", "envoy+epp", "envoy+epp-none"])
    peers = [p for p in args.peers.split(",") if p]
    modes = [m for m in (args.modes or ("pinned" if args.quick else ",".join(MODES))).split(",") if m]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    result = run(args.quick, rounds, args.profile, args.skip_streams, folder, args.open_streams, peers, modes,
                 args.reference_only)
    text = summary_text(result)
    (folder / "summary.md").write_text(text)
    (folder / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    results_of(result, args).write(folder)
    print(text)
    print(f"results: {folder}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


def results_of(r: dict[str, Any], args: argparse.Namespace) -> Results:
    """The targets (added latency, requests and relayed events per gateway core, open streams' memory) and the
    Rust router's CPU per request beside m3gate's, in the one results format."""
    results = Results("overhead", vars(args), reference="the same requests sent to the replicas directly, same run")
    c32 = r.get("nonstream_c32") or {}
    if c32:
        direct = c32["direct"]
        results.add("added latency p50 at c=32 (non-stream)", c32.get("added_p50_ms"), "ms", at_most=1.0,
                    reference="direct p50", reference_value=direct.get("p50_ms"))
        results.add("added latency p99 at c=32 (non-stream)", c32.get("added_p99_ms"), "ms", at_most=3.0,
                    reference="direct p99", reference_value=direct.get("p99_ms"))
        results.add("requests per gateway CPU-second (non-stream, c=32)", c32["gateway"].get("req_per_cpu_s"),
                    "req/CPU-s", at_least=2000)
    paced = (r.get("stream_paced_c64") or {})
    if paced:
        results.add("relayed SSE events per gateway CPU-second (paced, c=64)", paced["gateway"].get("events_per_cpu_s"),
                    "events/CPU-s", at_least=20000)
        results.add("ITL added p99 (paced, c=64)", paced.get("added_itl_p99_ms"), "ms")
    if "open_streams" in r:
        o = r["open_streams"]
        results.add("concurrent open streams", o["opened"], "streams", at_least=args.open_streams)
        results.add("gateway RSS peak with them open", o["gw_rss_peak_mib"], "MiB", at_most=1024)
    for mode, kinds in ((r.get("reference") or {}).get("modes") or {}).items():
        for key, label, _stream, conc in REFERENCE_KINDS:
            res = kinds.get(key) or {}
            mine = (res.get("m3gate") or {}).get("cpu_ms_per_req_median")
            rust = (res.get("sglang-router") or {}).get("cpu_ms_per_req_median")
            if mine and rust and conc > 1:  # the target is about load; at c=1 idle wake-ups dominate
                results.add(f"CPU per request ({label}, {mode})", mine, "ms", reference="SGLang router",
                            reference_value=rust, goal="≤ 2× the reference", passed=mine <= 2 * rust)
    return results


if __name__ == "__main__":
    sys.exit(main())
