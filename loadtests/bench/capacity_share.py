"""What sharing the capacity signal's demand between gateways costs (`state: redis`), per tick of the signal.

`python -m loadtests.bench.capacity_share [--url redis://127.0.0.1:6379/7] [--gateways 2 8] [--quick] [--out DIR]`
measures (results.json in DIR, loadtests/lib/results.py):

- `tick, local`: one tick of a gateway sizing from its own demand (what `state: memory` does) — the baseline;
- `measure (a local tick's first part)`: the gateway's own share, which a local tick builds too;
- `measure+encode+decode+merge (G)`: the same plus what sharing adds (its share encoded, G−1 others' decoded and
  merged): the difference with the row above is the sharing's CPU per tick. The sizing that follows is the local
  tick's, on the summed demand (its cost grows a little with the replica count searched, not with the gateways);
- `exchange (G gateways)`: `RedisState.exchange_capacity` on a real Redis with G−1 other gateways registered: one
  pipelined round trip (SET of its share with a TTL, MGET of the others'), wall time;
- the share's size in bytes.

The gateway is a real (unstarted) one with 3 pools (one disaggregated) × 4 traffic classes, fed finished requests
for a full window. Redis keys live under a fresh prefix and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from gateway.app import build_app
from gateway.record import RequestRecord
from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from policies.config import GatewayConfig
from policies.demand_share import decode, encode, merge
from pools.shared_state import RedisState

CLASSES = {"interactive": {"targets": {"ttft_ms": {"p95": 1000}, "tpot_ms": {"p95": 50}}},
           "agent": {"priority": 1, "targets": {"ttft_ms": {"p95": 3000}, "tpot_ms": {"p95": 60}}},
           "repository": {"priority": 2, "targets": {"ttft_ms": {"p95": 8000}, "tpot_ms": {"p95": 80}}},
           "batch": {"priority": 3}}
CONFIG = {
    "model": "MiniMaxAI/MiniMax-M3",
    "pools": [
        {"name": "short", "max_model_len": 32768, "kv_blocks": 4000,
         "endpoints": [f"http://10.0.0.{i}:8000" for i in range(8)]},
        {"name": "long", "max_model_len": 131072, "kv_blocks": 8000,
         "endpoints": [f"http://10.0.1.{i}:8000" for i in range(4)]},
        {"name": "extended", "max_model_len": 1048576, "kv_blocks": 16000,
         "disaggregation": {"prefill": {"endpoints": ["http://10.0.2.1:8000", "http://10.0.2.2:8000"]},
                            "decode": {"endpoints": ["http://10.0.3.1:8000", "http://10.0.3.2:8000"]}}},
    ],
    "traffic": {"classes": CLASSES},
    "capacity": {"window_s": 60, "interval_s": 5, "startup_s": 0},
}


class _Fed:
    """A gateway fed 20 finished requests a second over its pools and classes, ticking every 5 s of its own clock
    (the records are timed by it: no waiting)."""

    def __init__(self) -> None:
        self.gw = build_app(GatewayConfig.model_validate(CONFIG)).state.gateway
        self.now = self.gw.clock()
        self.pools = [p["name"] for p in CONFIG["pools"]]
        for _ in range(12):  # a full window first
            self.feed()
            self.gw.capacity.tick(self.now)

    def feed(self, seconds: int = 5) -> None:
        for second in range(seconds):
            for i in range(20):
                at = self.now + second + i / 20
                self.gw.capacity.observe(RequestRecord(
                    api="chat", stream=True, t_arrival=at, pool=self.pools[i % 3], replica="",
                    traffic_class=list(CLASSES)[i % 4], status=200, prompt_tokens_est=4000, t_sent=at,
                    t_first_byte=at + 0.2, t_last_byte=at + 2.0,
                    usage={"prompt_tokens": 4000, "completion_tokens": 300,
                           "prompt_tokens_details": {"cached_tokens": 1000}}))
        self.now += seconds


def _timed(fed: _Fed, step: Any, n: int) -> list[float]:
    """`step(now)` after each 5 s of requests: µs each."""
    out = []
    for _ in range(n):
        fed.feed()
        start = time.perf_counter()
        step(fed.now)
        out.append((time.perf_counter() - start) * 1e6)
    return out


def _print(name: str, samples_us: list[float]) -> dict[str, Any]:
    p50, p99 = statistics.median(samples_us), sorted(samples_us)[int(0.99 * (len(samples_us) - 1))]
    print(f"{name:<34} n={len(samples_us):>5}  p50={p50:>9.1f} µs  p99={p99:>9.1f} µs")
    return {"name": name, "p50_us": round(p50, 1), "p99_us": round(p99, 1)}


def bench_cpu(gateways: list[int], n: int, rows: list[dict[str, Any]]) -> bytes:
    local = _Fed()
    rows.append(_print("tick, local", _timed(local, local.gw.capacity.tick, n)))
    rows.append(_print("measure (a local tick's first part)", _timed(local, local.gw.capacity.measure, n)))
    blob = encode(local.gw.capacity.measure(local.now))
    print(f"share: {len(blob)} bytes (3 pools, 4 classes, signal memory of 4 pool roles)")
    for g in gateways:
        fed = _Fed()
        cap = fed.gw.capacity
        blobs = [blob] * (g - 1)

        def merging(now: float) -> None:
            own = cap.measure(now)
            merge([own, *(decode(b) for b in blobs)])
            encode(own)

        rows.append(_print(f"measure+encode+decode+merge ({g})", _timed(fed, merging, n)))
    return blob


async def bench_redis(url: str, gateways: list[int], n: int, blob: bytes, rows: list[dict[str, Any]]) -> None:
    prefix = f"m3gate-bench:{uuid.uuid4().hex}:"
    try:
        for g in gateways:
            states = [RedisState(url, lambda *a: None, dict, key_prefix=f"{prefix}{g}:") for _ in range(g)]
            for s in states:
                await s.start()
            try:
                me = states[0]
                deadline = time.monotonic() + 5
                while len(me._peers) < g - 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                for s in states[1:]:
                    await s.exchange_capacity(blob, 60)
                samples = []
                for _ in range(n):
                    start = time.perf_counter()
                    got = await me.exchange_capacity(blob, 60)
                    samples.append((time.perf_counter() - start) * 1e6)
                    assert got is not None and len(got) == g, (g, got and len(got))
                rows.append(_print(f"exchange ({g} gateways)", samples))
            finally:
                for s in states:
                    await s.stop()
    finally:
        client = aioredis.Redis.from_url(url)
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def results_of(rows: list[dict[str, Any]], share_bytes: int, args: argparse.Namespace) -> Results:
    """Each step's p50 (the shared tick's beside the local measure it extends), the exchange's round trip and the
    share's size, in the one results format."""
    out = Results("capacity_share", vars(args), reference="a local tick (state: memory), same run")
    local = {row["name"]: row["p50_us"] for row in rows}.get("measure (a local tick's first part)")
    for row in rows:
        beside: dict[str, Any] = ({"reference": "measure alone", "reference_value": local}
                                  if row["name"].startswith("measure+") else {})
        out.add(f"{row['name']} p50", row["p50_us"], "µs", **beside)
        out.add(f"{row['name']} p99", row["p99_us"], "µs")
    out.add("share size", share_bytes, "B")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/7")
    parser.add_argument("--gateways", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-capacity_share)")
    args = parser.parse_args(argv)
    n = 50 if args.quick else 300
    rows: list[dict[str, Any]] = []
    blob = bench_cpu(args.gateways, n, rows)
    asyncio.run(bench_redis(args.url, args.gateways, n, blob, rows))
    folder = args.out or run_dir("capacity_share")
    results_of(rows, len(blob), args).write(folder)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
