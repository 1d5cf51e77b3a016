"""What the status page costs the gateway: `python -m loadtests.bench.ui [--refreshes N]`.

1. Per request, in process: `RecentRequests.add` (Coordinator.finished calls it for every request) with the page
   closed (a comparison) and open (a deque append), against an empty call.
2. Per refresh, a real gateway process in front of simulated pools (3 pools × 2 replicas, histograms and the ring
   filled by streamed requests): the gateway's CPU time (user + system, from /proc) over N GET /ui/state, divided
   by N, and the JSON's size; then its CPU over the same wall time with the page closed and no traffic.
Results: printed, and results.json + bench_ui.json in the run's folder (`--out`, default loadtests/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.launcher import start_gateway
from gateway.record import RequestRecord
from gateway.observability.recent import RecentRequests
from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
KEY = "bench-ui-admin-key"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_ring(n: int = 1_000_000) -> dict[str, float]:
    record = RequestRecord("chat", True, time.monotonic())
    ring = RecentRequests()

    def per_call(fn: Any) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn(record)
            best = min(best, (time.perf_counter() - t) / n)
        return best

    def empty(_: RequestRecord) -> None:
        return None

    base = per_call(empty)
    closed = per_call(ring.add)
    ring.watched(time.monotonic() + 3600)
    opened = per_call(ring.add)
    return {"empty_call_ns": round(base * 1e9, 1), "closed_ns": round((closed - base) * 1e9, 1),
            "open_ns": round((opened - base) * 1e9, 1)}


def bench_refresh(refreshes: int, requests: int) -> dict[str, Any]:
    specs = [{"max_model_len": m, "extra_args": ["--speed", "20"]} for m in (32768, 32768, 131072, 131072,
                                                                             1048576, 1048576)]
    with running_sims(specs) as sims:
        config = {
            "model": MODEL,
            "pools": [{"name": name, "max_model_len": m, "endpoints": [sims[i].url, sims[i + 1].url]}
                      for i, (name, m) in zip((0, 2, 4), (("interactive", 32768), ("repository", 131072),
                                                          ("extended", 1048576)))],
            "admin": {"api_key": KEY, "watch_config": False},
        }
        gw = start_gateway(config)
        try:
            headers = {"authorization": f"Bearer {KEY}"}
            with httpx.Client(timeout=30) as client:
                client.get(gw.url + "/ui/state", headers=headers)  # the page opens: the ring records
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 16,
                        "stream": True}
                for _ in range(requests):
                    with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
                        for _ in resp.iter_bytes():
                            pass
                time.sleep(1.0)
                size = len(client.get(gw.url + "/ui/state", headers=headers).content)
                cpu0, t0 = _cpu_s(gw.pid), time.perf_counter()
                for _ in range(refreshes):
                    client.get(gw.url + "/ui/state", headers=headers)
                cpu1, wall = _cpu_s(gw.pid), time.perf_counter() - t0
                time.sleep(1.0)  # the page closes: nothing of it runs (its ring records nothing without requests)
                idle0 = _cpu_s(gw.pid)
                time.sleep(10.0)
                idle_cpu = _cpu_s(gw.pid) - idle0
        finally:
            gw.stop()
    return {"refreshes": refreshes, "state_bytes": size, "cpu_ms_per_refresh": round((cpu1 - cpu0) / refreshes * 1e3, 3),
            "wall_ms_per_refresh": round(wall / refreshes * 1e3, 3),
            "idle_cpu_percent_page_closed": round(idle_cpu / 10.0 * 100, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refreshes", type=int, default=500)
    parser.add_argument("--requests", type=int, default=80, help="streamed requests before measuring")
    parser.add_argument("--quick", action="store_true", help="200 refreshes after 30 requests")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-ui)")
    args = parser.parse_args(argv)
    if args.quick:
        args.refreshes, args.requests = 200, 30
    ring = bench_ring()
    print(f"RecentRequests.add per request: page closed +{ring['closed_ns']} ns, open +{ring['open_ns']} ns "
          f"(an empty call {ring['empty_call_ns']} ns)")
    refresh = bench_refresh(args.refreshes, args.requests)
    print(f"GET /ui/state: {refresh['cpu_ms_per_refresh']} ms of gateway CPU per refresh "
          f"({refresh['state_bytes']} bytes, {refresh['wall_ms_per_refresh']} ms wall); "
          f"page closed, no traffic: {refresh['idle_cpu_percent_page_closed']}% of a core")
    folder = args.out or run_dir("ui")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_ui.json").write_text(json.dumps({"ring": ring, "refresh": refresh}, indent=2) + "\n")
    results = Results("ui", vars(args), reference="an empty call (what the ring adds beyond it)")
    results.add("RecentRequests.add per request, page closed", ring["closed_ns"], "ns")
    results.add("RecentRequests.add per request, page open", ring["open_ns"], "ns")
    results.add("gateway CPU per /ui/state refresh", refresh["cpu_ms_per_refresh"], "ms")
    results.add("idle CPU, page closed, no traffic", refresh["idle_cpu_percent_page_closed"], "%")
    print(f"results: {results.write(folder).parent}")
    print(f"status page: {refresh['cpu_ms_per_refresh']} ms CPU per refresh, ring +{ring['closed_ns']} ns closed / "
          f"+{ring['open_ns']} ns open per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
