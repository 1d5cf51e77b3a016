"""What sharing routing state through Redis costs, and how fast it propagates.

`python -m loadtests.bench.shared_state [--url redis://127.0.0.1:6379/7] [--quick] [--out DIR]` measures, with a
real Redis (results.json in `--out`, loadtests/lib/results.py):

- `on_dispatch`: the gateway's hot-path cost per request (a buffer append; target: a few µs p99);
- `remote_in_flight`: the per-replica lookup made when building snapshots;
- `encode` / `decode`: the CPU cost per dispatch on the flusher and on the reader;
- `flush`: one pipelined flush (XADDs + in-flight SET) by batch size, round trip included;
- `propagation`: gateway A's `on_dispatch` → gateway B's `apply_remote`, two RedisStates in one process (one clock),
  with A dispatching at a steady rate (the flush interval dominates: ~interval/2 on average).

Keys live under a fresh prefix and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from policies.snapshot import RoutingRequest
from pools.shared_state import RedisState, decode_batch, encode_batch, encode_dispatch


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(name: str, samples_us: list[float]) -> dict[str, Any]:
    row = {"name": name, "n": len(samples_us), "p50_us": round(_pct(samples_us, 0.5), 2),
           "p99_us": round(_pct(samples_us, 0.99), 2), "mean_us": round(statistics.fmean(samples_us), 2)}
    print(f"{name:<34} n={row['n']:>6}  p50={row['p50_us']:>9.2f} µs  p99={row['p99_us']:>9.2f} µs  "
          f"mean={row['mean_us']:>9.2f} µs")
    return row


def _request(i: int, blocks: int) -> RoutingRequest:
    return RoutingRequest(blocks * 128, 4096, tuple(range(i << 20, (i << 20) + blocks)), f"session-{i % 100}")


def bench_hot_path(rows: list[dict[str, Any]], n: int) -> None:
    state = RedisState("redis://127.0.0.1:1/0", lambda *a: None, dict, max_buffer=n + 1)  # never started: no I/O
    requests = [_request(i, 64) for i in range(n)]
    per_call: list[float] = []
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for req in requests:
            t0 = clock()
            state.on_dispatch("interactive", "http://10.0.0.7:8000", req)
            per_call.append((clock() - t0) / 1000)
        state._buffer.clear()
        t0 = clock()
        for req in requests:
            state.on_dispatch("interactive", "http://10.0.0.7:8000", req)
        bulk = (clock() - t0) / 1000 / n
        state._remote = {f"http://10.0.0.{i}:8000": i for i in range(16)}
        lookups: list[float] = []
        for _ in range(n):
            t0 = clock()
            state.remote_in_flight("http://10.0.0.7:8000")
            lookups.append((clock() - t0) / 1000)
    finally:
        gc.enable()
    rows.append(_row("on_dispatch (timed per call)", per_call))
    print(f"{'on_dispatch (tight loop mean)':<34} {bulk:.3f} µs per call")
    rows.append({"name": "on_dispatch (tight loop mean)", "mean_us": round(bulk, 3)})
    rows.append(_row("remote_in_flight", lookups))

    for blocks in (64, 256):
        enc, dec = [], []
        for i in range(2000):
            req = _request(i, blocks)
            t0 = clock()
            blob = encode_batch([encode_dispatch("interactive", "http://10.0.0.7:8000", req)])
            t1 = clock()
            decode_batch(blob)
            t2 = clock()
            enc.append((t1 - t0) / 1000)
            dec.append((t2 - t1) / 1000)
        rows.append(_row(f"encode ({blocks} blocks)", enc))
        rows.append(_row(f"decode ({blocks} blocks)", dec))


async def bench_flush(rows: list[dict[str, Any]], url: str, prefix: str) -> None:
    state = RedisState(url, lambda *a: None, lambda: {"http://10.0.0.7:8000": 3}, key_prefix=prefix)
    await state.start()
    try:
        for batch in (0, 1, 10, 100):
            samples = []
            for round_ in range(60 if batch < 100 else 30):
                for i in range(batch):
                    state.on_dispatch("interactive", "http://10.0.0.7:8000", _request(round_ * 1000 + i, 64))
                state._published = None  # force the in-flight SET, as after a change
                t0 = time.perf_counter()
                await state.flush()
                samples.append((time.perf_counter() - t0) * 1e6)
            rows.append(_row(f"flush ({batch} dispatches x 64 blocks)", samples))
    finally:
        await state.stop()


async def bench_propagation(rows: list[dict[str, Any]], url: str, prefix: str, n: int, rate: float) -> None:
    applied_at: dict[int, float] = {}

    def on_b(pool: str, replica: str, request: RoutingRequest) -> None:
        applied_at[request.block_hashes[0]] = time.perf_counter()

    a = RedisState(url, lambda *x: None, dict, key_prefix=prefix)
    b = RedisState(url, on_b, dict, key_prefix=prefix)
    await a.start()
    await b.start()
    sent_at: dict[int, float] = {}
    try:
        interval = 1.0 / rate
        start = time.perf_counter()
        for i in range(n):
            req = _request(i + 1, 64)
            sent_at[req.block_hashes[0]] = time.perf_counter()
            a.on_dispatch("interactive", "http://10.0.0.7:8000", req)
            delay = start + (i + 1) * interval - time.perf_counter()
            await asyncio.sleep(max(0.0, delay))
        deadline = time.perf_counter() + 5
        while len(applied_at) < n and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await a.stop()
        await b.stop()
    lat = [(applied_at[k] - t) * 1e6 for k, t in sent_at.items() if k in applied_at]
    print(f"propagation: {len(lat)}/{n} dispatches applied by B at {rate:.0f}/s "
          f"(flush every {a.flush_interval_s * 1000:.0f} ms)")
    row = _row("propagation A.on_dispatch→B.apply", lat)
    row["ms"] = {"p50": round(row["p50_us"] / 1000, 2), "p99": round(row["p99_us"] / 1000, 2)}
    row["lost"] = n - len(lat)
    rows.append(row)


async def _cleanup(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bench_hot_path(rows, args.n)
    prefix = f"m3gate-bench:{uuid.uuid4().hex}:"
    try:
        await bench_flush(rows, args.url, prefix)
        await bench_propagation(rows, args.url, prefix, args.propagation, args.rate)
    finally:
        await _cleanup(args.url, prefix)
    return rows


def results_of(rows: list[dict[str, Any]], args: argparse.Namespace) -> Results:
    """Each row's p50 and p99 (µs; propagation in ms), in the one results format."""
    out = Results("shared_state", vars(args), reference="none: each step's own cost against a real Redis")
    for row in rows:
        if "ms" in row:
            out.add(f"{row['name']} p50", row["ms"]["p50"], "ms")
            out.add(f"{row['name']} p99", row["ms"]["p99"], "ms")
        elif "p50_us" in row:
            out.add(f"{row['name']} p50", row["p50_us"], "µs")
            out.add(f"{row['name']} p99", row["p99_us"], "µs")
        else:
            out.add(row["name"], row["mean_us"], "µs")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/7")
    parser.add_argument("--n", type=int, default=100_000, help="on_dispatch calls timed")
    parser.add_argument("--propagation", type=int, default=1000, help="dispatches timed end to end")
    parser.add_argument("--rate", type=float, default=500.0, help="A's dispatches per second")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--quick", action="store_true", help="10,000 calls, 200 dispatches end to end")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-shared_state)")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.propagation = 10_000, 200
    rows = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    folder = args.out or run_dir("shared_state")
    results_of(rows, args).write(folder)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
