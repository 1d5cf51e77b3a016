"""What telemetry costs the gateway: CPU per request with metrics and tracing on vs off.

`python -m loadtests.bench.telemetry [--requests 2000] [--rounds 12] [--sessions 3] [--concurrency 8]
[--max-tokens 16] [--quick] [--out DIR]` (results.json and bench_telemetry.json in DIR, loadtests/lib/results.py)

The modes (`modes`): telemetry off, metrics only, metrics + tracing sampled at 1%, 5%, 10% and 100% exported over
OTLP/HTTP to a local sink (`OtlpSink`: the gateway pays the SDK's protobuf encoding and the HTTP request, as with a
real collector), and metrics + every request's spans built but dropped (exporter "discard": the cost of tracing
without its export). Six of them (E2E_MODES) run as gateway processes side by side, pinned to one core, in front of
one `--instant` simulated replica (no modelled delay, so the gateway's own work dominates), with the load generator
pinned to the other core.

Each round sends the same streamed chat requests to each gateway in turn (the order alternating, so that neighbouring
runs meet the same machine conditions) and reads the CPU time of the gateway's threads to the nanosecond
(/proc/PID/task/*/schedstat) before and after. The event loop's window ends with the last answer; the other threads'
a little after the export worker's next wake-up (OTEL_BSP_SCHEDULE_DELAY set to EXPORT_DELAY_MS), so every span of
the window is exported inside it. That short delay makes exports smaller and more frequent than with the default 5 s,
so the per-export cost (an HTTP request) weighs more here than in production. The rounds are split between --sessions
sets of fresh gateway processes: a process stays a few per cent faster or slower for life (its memory layout), so no
mode keeps one process's luck for the whole run; each set shares one PYTHONHASHSEED.

Reported: the median CPU per request of each mode, how much of it ran off the event loop (the export worker), and
the median of the per-round ratios to "off". The target: metrics + tracing at the sampling ratio deploy/ recommends
(TARGET_MODE) add at most 5%. Because process CPU on a shared 2-core machine moves by a few per cent between rounds,
the hooks are also timed alone in this process on the same kind of request (start, inject, the relay's per-chunk
inter-token latency observation, finish, and the export of the spans in this thread, at the batch size the worker
would use; best of 3 interleaved runs), and what they add over "off" is shown as a share of the "off" gateway's CPU
per request, beside the measured ratio."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.launcher import GatewayProcess, start_gateway
from gateway.precise import PreciseRouting
from gateway.record import RequestRecord
from gateway.observability.telemetry import SpanBatcher, Telemetry
from loadtests.bench.overhead import GW_CPU, LOAD_CPU
from loadtests.lib.harness import run_dir
from loadtests.lib.replicas import pin, thread_cpu_seconds
from loadtests.lib.results import Results
from policies.config import GatewayConfig
from pools.prefix_index import PrefixIndex
from pools.replicas import PoolRuntime
from pools.sim.launcher import start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
TARGET = 0.05  # metrics and tracing add at most 5% to the gateway's CPU per request
TARGET_MODE = "metrics+tracing@1%"  # what deploy/ recommends (and the gateway's warning)
E2E_MODES = ("off", "metrics", TARGET_MODE, "metrics+tracing@5%", "metrics+tracing@100%",
             "metrics+spans@100%,no export")
EXPORT_DELAY_MS = 1000  # the gateways' OTEL_BSP_SCHEDULE_DELAY (default 5000): exports inside each measured window
EXPORT_SETTLE_S = EXPORT_DELAY_MS / 1000 + 0.2


def modes(sink: str) -> dict[str, dict[str, Any]]:
    """The telemetry settings compared, each in its own gateway; `sink` is the OTLP/HTTP endpoint spans go to."""
    otlp = {"enabled": True, "exporter": "otlp", "protocol": "http/protobuf", "endpoint": sink}
    return {
        "off": {"metrics": False, "tracing": {"enabled": False}},
        "metrics": {"metrics": True, "tracing": {"enabled": False}},
        "metrics+tracing@1%": {"metrics": True, "tracing": {**otlp, "sample_ratio": 0.01}},
        "metrics+tracing@5%": {"metrics": True, "tracing": {**otlp, "sample_ratio": 0.05}},
        "metrics+tracing@10%": {"metrics": True, "tracing": {**otlp, "sample_ratio": 0.1}},
        "metrics+tracing@100%": {"metrics": True, "tracing": {**otlp, "sample_ratio": 1.0}},
        "metrics+spans@100%,no export": {"metrics": True, "tracing": {"enabled": True, "exporter": "discard",
                                                                       "sample_ratio": 1.0}},
    }


class OtlpSink:
    """A local OTLP/HTTP endpoint (in this process, on the load core): reads each export request whole and answers
    200, what a collector does before its own work. The gateway pays for what it would pay with a real collector:
    encoding the spans to protobuf and the HTTP request. With `keep`, the request bodies are kept (tests decode them
    as ExportTraceServiceRequest)."""

    def __init__(self, keep: bool = False) -> None:
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's requests session expects

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                size = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(size)
                if keep:
                    sink.bodies.append(body)
                sink.exports += 1
                sink.bytes += size
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.exports = 0
        self.bytes = 0
        self.bodies: list[bytes] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def send(url: str, n: int, concurrency: int, max_tokens: int) -> int:
    """n streamed chat requests, `concurrency` at a time; returns how many got a 200."""
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "system", "content": "You are a terse assistant."},
                         {"role": "user", "content": "How fast is this gateway?"}]}
    ok = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        async def worker() -> None:
            nonlocal ok
            while not queue.empty():
                queue.get_nowait()
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_raw():
                        pass
                    ok += resp.status_code == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def measure(gw: GatewayProcess, n: int, concurrency: int, max_tokens: int) -> tuple[float, float]:
    """Gateway CPU microseconds per request over n requests: all threads, and the threads other than the event
    loop's (the span export worker's, mostly). The event loop's window ends with the last answer; the other threads'
    EXPORT_SETTLE_S later, so that the export worker (waking every EXPORT_DELAY_MS) has exported every span of these
    requests inside it."""
    main0, others0 = thread_cpu_seconds(gw.pid)
    ok = asyncio.run(send(gw.url, n, concurrency, max_tokens))
    main1, _ = thread_cpu_seconds(gw.pid)  # the event loop's share ends with the last answer (then it idles)
    time.sleep(EXPORT_SETTLE_S)
    _, others1 = thread_cpu_seconds(gw.pid)
    if ok != n:
        raise RuntimeError(f"only {ok}/{n} requests succeeded on {gw.url}:\n{gw.log_tail()}")
    others = (others1 - others0) / n * 1e6
    return (main1 - main0) / n * 1e6 + others, others


class _StubGateway:
    """What Telemetry reads from a Gateway, for timing its hooks alone."""

    def __init__(self, telemetry: dict[str, Any]) -> None:
        self.config = GatewayConfig.model_validate({
            "model": MODEL, "pools": [{"name": "interactive", "max_model_len": 32768,
                                        "endpoints": ["http://10.0.0.1:8000"]}], "telemetry": telemetry})
        self.pools = {p.name: PoolRuntime.from_config(p) for p in self.config.pools}
        self.clock = time.monotonic
        self.precise = PreciseRouting(PrefixIndex(), self.clock)


def hook_cost_us(telemetry: dict[str, Any], n: int = 20_000, chunks: int = 16) -> float:
    """CPU µs per request spent in start + inject + finish for a streamed chat request, plus the relay's per-chunk
    inter-token latency hook for `chunks` chunks, measured in this process: the same work the gateway does, without
    the noise of a shared machine."""
    gateway = _StubGateway(telemetry)
    # the export worker stays asleep (no timed wake-ups; the loop flushes before the queue would wake it): this
    # thread builds and exports every span, at the batch size the gateway's worker would use
    hooks = Telemetry(gateway, env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "3600000"})
    tracing = hooks.tracing
    processor = tracing.processor if tracing is not None else None
    assert processor is None or isinstance(processor, SpanBatcher)
    usage = {"prompt_tokens": 40, "completion_tokens": 16, "prompt_tokens_details": {"cached_tokens": 0}}
    began = time.thread_time()  # this thread's: not the OTLP sink's, which serves the exports in another
    for i in range(n):
        t = time.monotonic()
        record = RequestRecord(api="chat", stream=True, t_arrival=t)
        record.path = "/v1/chat/completions"
        hooks.start(record, {"user-agent": "bench"})
        record.thinking_mode, record.prompt_tokens_est, record.first_pool, record.pool_reason = \
            "adaptive", 40, "interactive", "fits"
        record.t_classified = record.t_routed = t + 0.0005
        record.pool, record.replica, record.reason, record.attempts = "interactive", "http://10.0.0.1:8000", \
            "least_loaded", 1
        headers: dict[str, str] = {}
        hooks.inject(record, headers)
        itl = record.itl  # what gateway/relay.py's pump does per chunk
        if itl is not None:
            counts, bounds = itl
            first = last = time.monotonic()
            for _ in range(chunks - 1):
                now = time.monotonic()
                counts[bisect_left(bounds, now - last)] += 1.0
                last = now
            counts[-1] += last - first
        record.t_sent, record.t_headers, record.status = t + 0.001, t + 0.002, 200
        record.t_first_byte, record.t_last_byte, record.usage = t + 0.01, t + 0.05, usage
        hooks.finish(record)
        if processor is not None and len(processor._queue) >= processor._wake_at - 1:
            processor.force_flush()
    if processor is not None:
        processor.force_flush()
    spent = time.thread_time() - began
    if hooks.tracing is not None:
        hooks.tracing.provider.shutdown()
    return spent / n * 1e6


def start_gateways(measured: dict[str, dict[str, Any]], sim_url: str, hash_seed: int) -> dict[str, GatewayProcess]:
    """One gateway process per mode, pinned to the gateway core, all with the same PYTHONHASHSEED (so that their
    dicts are laid out alike, one source of difference between processes less)."""
    gateways: dict[str, GatewayProcess] = {}
    try:
        for mode, telemetry in measured.items():
            gateways[mode] = start_gateway({
                "model": MODEL,
                "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": [sim_url]}],
                "admin": {"watch_config": False},
                "telemetry": telemetry,
            }, workdir=tempfile.mkdtemp(prefix="m3gate-bench-" + re.sub(r"[^a-z0-9]+", "-", mode) + "-"),
                env={"OTEL_BSP_SCHEDULE_DELAY": str(EXPORT_DELAY_MS), "PYTHONHASHSEED": str(hash_seed)})
            pin(gateways[mode].pid, GW_CPU)
    except BaseException:
        for gw in gateways.values():
            gw.stop()
        raise
    return gateways


def run(requests: int, rounds: int, concurrency: int, max_tokens: int, sessions: int) -> dict[str, Any]:
    pinned = pin(os.getpid(), LOAD_CPU)  # as in bench_overhead: gateways on one core, load and replica on the other
    sink = OtlpSink()
    settings = modes(sink.url)
    measured = {mode: settings[mode] for mode in E2E_MODES}  # hooks alone: every mode; end to end: these
    sim = start_sim(32768, extra_args=["--instant", "--mean-output-tokens", "0"])
    pin(sim.pid, LOAD_CPU)
    samples: dict[str, list[float]] = {mode: [] for mode in measured}
    off_loop: dict[str, list[float]] = {mode: [] for mode in measured}
    ratios: dict[str, list[float]] = {mode: [] for mode in measured}
    try:
        # A process runs a little faster or slower for life (memory layout, address-space randomisation): fresh
        # gateway processes for each session, so that no mode keeps one process's luck for the whole run.
        for session in range(sessions):
            gateways = start_gateways(measured, sim.url, session + 1)
            try:
                for gw in gateways.values():  # warm up: imports, connection pools, tokenizer caches
                    measure(gw, min(300, requests), concurrency, max_tokens)
                for r in range(session * rounds // sessions, (session + 1) * rounds // sessions):
                    # Short rounds, modes back to back, order alternating: each ratio compares runs a few seconds
                    # apart, which on a shared machine varies far less than runs a minute apart.
                    order = list(measured) if r % 2 == 0 else list(reversed(measured))
                    got = {mode: measure(gateways[mode], requests, concurrency, max_tokens) for mode in order}
                    for mode, (us, others) in got.items():
                        samples[mode].append(us)
                        off_loop[mode].append(others)
                        ratios[mode].append(us / got["off"][0])
                    print(f"round {r + 1:2d}: " + ", ".join(f"{m} {got[m][0]:.1f}" for m in measured) + " µs",
                          flush=True)
            finally:
                for gw in gateways.values():
                    gw.stop()  # SIGTERM: each flushes its last spans to the sink
    finally:
        sim.stop()
    exported = {"requests": sink.exports, "bytes": sink.bytes}
    runs: dict[str, list[float]] = {mode: [] for mode in settings}
    for _ in range(3):  # interleaved, best of 3: the least disturbed run of each
        for mode, telemetry in settings.items():
            runs[mode].append(hook_cost_us(telemetry, chunks=max_tokens))
    sink.close()
    hooks = {mode: min(values) for mode, values in runs.items()}
    off = statistics.median(samples["off"])
    return {
        "settings": settings,
        "hook_cpu_us_per_request": hooks,
        "hook_share_of_off": {mode: hooks[mode] / off for mode in settings},
        "hook_added_share_of_off": {mode: (hooks[mode] - hooks["off"]) / off for mode in settings},
        "pinned": pinned, "requests_per_round": requests, "rounds": rounds, "sessions": sessions,
        "concurrency": concurrency,
        "max_tokens": max_tokens, "otlp_sink": exported,
        "cpu_us_per_request": {mode: statistics.median(values) for mode, values in samples.items()},
        "off_loop_cpu_us_per_request": {mode: statistics.median(values) for mode, values in off_loop.items()},
        "ratio_vs_off": {mode: statistics.median(values) for mode, values in ratios.items()},
        "samples": samples,
    }


def verdict(share: float) -> str:
    return "OK" if share <= TARGET else "OVER TARGET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per gateway per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds; medians are reported (default 12)")
    parser.add_argument("--sessions", type=int, default=3,
                        help="fresh gateway processes this many times, rounds split between them (default 3)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    parser.add_argument("--quick", action="store_true", help="300 requests, 2 rounds, one set of processes")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-telemetry)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.sessions = 300, 2, 1
    started = time.monotonic()
    result = run(args.requests, args.rounds, args.concurrency, args.max_tokens, max(1, min(args.sessions, args.rounds)))
    print()
    hooks, off_hooks = result["hook_cpu_us_per_request"], result["hook_cpu_us_per_request"]["off"]
    print(f"{'mode':>29} | {'gateway CPU/request':>19} | {'of it off-loop':>14} | {'vs off':>7} | "
          f"{'hooks alone':>11} | {'added':>8} | {'added / off CPU':>15}")
    for mode in result["settings"]:
        if mode in result["cpu_us_per_request"]:
            measured = (f"{result['cpu_us_per_request'][mode]:16.1f} µs | "
                        f"{result['off_loop_cpu_us_per_request'][mode]:11.1f} µs | "
                        f"{(result['ratio_vs_off'][mode] - 1) * 100:+6.1f}%")
        else:
            measured = f"{'(hooks only)':>19} | {'':>14} | {'':>7}"
        print(f"{mode:>29} | {measured} | "
              f"{hooks[mode]:8.1f} µs | {hooks[mode] - off_hooks:5.1f} µs | "
              f"{result['hook_added_share_of_off'][mode] * 100:14.1f}%")
    sink = result["otlp_sink"]
    print(f"OTLP sink: {sink['requests']} export requests, {sink['bytes'] / 1e6:.1f} MB")
    for mode in (TARGET_MODE, "metrics+tracing@5%", "metrics+tracing@100%"):
        extra = result["ratio_vs_off"][mode] - 1
        added = result["hook_added_share_of_off"][mode]
        print(f"{mode}{' (the target setting)' if mode == TARGET_MODE else ''}, target ≤ +{TARGET * 100:.0f}% CPU per "
              f"request: measured {extra * 100:+.1f}% ({verdict(extra)}), hooks timed alone {added * 100:+.1f}% "
              f"({verdict(added)})")
    print(f"[{time.monotonic() - started:.0f} s]")
    folder = args.out or run_dir("telemetry")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_telemetry.json").write_text(json.dumps(result, indent=2) + "\n")
    results_of(result, args).write(folder)
    print(f"results: {folder}")
    return 0


def results_of(result: dict[str, Any], args: argparse.Namespace) -> Results:
    """Each mode's gateway CPU per request beside "off", and the target (TARGET_MODE adds at most TARGET), measured
    and from the hooks timed alone, in the one results format."""
    out = Results("telemetry", vars(args), reference="the same gateway with telemetry off, same rounds")
    cpu = result["cpu_us_per_request"]
    for mode, value in cpu.items():
        if mode != "off":
            out.add(f"gateway CPU per request, {mode}", value, "µs", reference="off", reference_value=cpu.get("off"))
    out.add(f"CPU per request added by {TARGET_MODE}, measured", (result["ratio_vs_off"][TARGET_MODE] - 1) * 100,
            "%", at_most=TARGET * 100)
    out.add(f"CPU per request added by {TARGET_MODE}, hooks timed alone",
            result["hook_added_share_of_off"][TARGET_MODE] * 100, "%", at_most=TARGET * 100)
    return out


if __name__ == "__main__":
    sys.exit(main())
