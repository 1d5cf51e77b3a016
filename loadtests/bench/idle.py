"""The gateway's CPU with no request at all, as the pool grows, beside SGLang's Rust router idle in the same run.

    python -m loadtests.bench.idle [--quick] [--sizes 16,64,256] [--seconds 30] [--warmup 70]
                                   [--peer sglang-router:cache_aware] [--base DIR] [--out DIR]

For each pool size N, N zero-latency vLLM-like workers served by one process (loadtests.bench.scale's fleet), m3gate
(loadtests.lib.replicas.bench_config: probing at the default 2 s interval) and the peer in front of them, all idle:
after `--warmup` seconds (an idle replica's probes back off to their longest period, 16 × 2 s, within about a
minute: what is measured is the steady state), each proxy's CPU (utime + stime from /proc/PID/stat) over the same
`--seconds` window, as % of one core. What m3gate spends is its probing (health checks, /metrics scrapes) and its
timers; the peer's the same for its own health checks. The ratio m3gate ÷ peer is printed per N.

Goal: m3gate idle at N = 256 ≤ 1% of a core. `--base DIR` adds another m3gate checkout (`m3gate@DIR`, same config)
to the same run: a before/after.

`--quick`: N = 16 and 256, a 20 s window. Results in `--out`, by default loadtests/results/<time>-idle/:
results.json (loadtests/lib/results.py) and idle.md (the table).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

from loadtests.bench.scale import Fleet, Proxy
from loadtests.lib.harness import run_dir
from loadtests.lib.peers import start_peer
from loadtests.lib.replicas import GatewayProc, bench_config, cpu_seconds, raise_fd_limit
from loadtests.lib.results import Results

GOAL_N = 256
GOAL_PCT = 1.0  # % of a core, m3gate idle at GOAL_N replicas


def start_proxies(urls: Sequence[str], peers: Sequence[str]) -> list[Proxy]:
    """m3gate in front of `urls`, then each peer that starts (one that does not is skipped with a note)."""
    gw = GatewayProc(bench_config(urls), timeout=120)
    proxies = [Proxy("m3gate", gw.url, [gw.pid], gw.stop)]
    for name in peers:
        try:
            p = start_peer(name, urls, timeout_s=180)
            proxies.append(Proxy(name, p.url, p.pids, p.stop))
        except RuntimeError as exc:
            print(f"  {name} skipped: {str(exc)[:300]}", flush=True)
    return proxies


def idle_pct(proxies: Sequence[Proxy], seconds: float) -> dict[str, float]:
    """Each proxy's CPU over the same window, % of one core."""
    before = {p.name: sum(cpu_seconds(pid) for pid in p.pids) for p in proxies}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {p.name: (sum(cpu_seconds(pid) for pid in p.pids) - before[p.name]) / wall * 100.0 for p in proxies}


def measure_size(n: int, peers: Sequence[str], warmup: float, seconds: float) -> dict[str, float]:
    fleet = Fleet(n)
    proxies: list[Proxy] = []
    try:
        proxies = start_proxies(fleet.urls, peers)
        time.sleep(warmup)
        return idle_pct(proxies, seconds)
    finally:
        for p in proxies:
            p.stop()
        fleet.stop()


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def report(sizes: dict[int, dict[str, float]], peer: str | None, base: str | None) -> str:
    head = "| N | m3gate | " + (f"{base} | " if base else "") + "peer | × peer |"
    lines = [f"Proxy CPU idle (% of a core), zero-latency workers; peer: {peer or 'none'}", "", head,
             "|---" * (head.count("|") - 1) + "|"]
    for n, per in sorted(sizes.items()):
        mine, theirs = per.get("m3gate"), per.get(peer) if peer else None
        cells = [str(n), _fmt(mine)] + ([_fmt(per.get(base))] if base else []) + \
            [_fmt(theirs), _fmt(mine / theirs if mine is not None and theirs else None, ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_of(sizes: dict[int, dict[str, float]], peer: str | None, base: str | None,
               args: argparse.Namespace) -> Results:
    """m3gate's idle CPU at each N beside the peer's (and the base checkout's); the goal at N = 256."""
    results = Results("idle", vars(args), reference=f"{peer or 'no peer'} idle in front of the same workers, same run")
    for n, per in sorted(sizes.items()):
        theirs = per.get(peer) if peer else None
        bound = {"at_most": GOAL_PCT} if n == GOAL_N else {}
        results.add(f"idle CPU, N={n}", per.get("m3gate"), "%", reference=peer, reference_value=theirs, **bound)
        if base:
            results.add(f"idle CPU before ({base}), N={n}", per.get(base), "%", reference=peer,
                        reference_value=theirs)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.idle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", help="pool sizes, comma-separated (default 16,64,256; --quick: 16,256)")
    parser.add_argument("--seconds", type=float, default=None, help="the measured window (default 30; --quick 20)")
    parser.add_argument("--warmup", type=float, default=70.0,
                        help="seconds idle before the window (probes back off to their longest period)")
    parser.add_argument("--peer", default="sglang-router:cache_aware", help="'' for none")
    parser.add_argument("--base", type=Path, default=None, help="another m3gate checkout, measured beside")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default loadtests/results/<time>-idle/)")
    args = parser.parse_args(argv)
    raise_fd_limit(20_000)
    sizes = [int(s) for s in args.sizes.split(",") if s] if args.sizes else [16, 256] if args.quick else [16, 64, 256]
    seconds = args.seconds or (20.0 if args.quick else 30.0)
    peer = args.peer or None
    base = f"m3gate@{args.base}" if args.base else None
    peers = [p for p in (peer, base) if p]
    results: dict[int, dict[str, float]] = {}
    for n in sizes:
        print(f"N={n} ...", flush=True)
        results[n] = measure_size(n, peers, args.warmup, seconds)
        print("  " + ", ".join(f"{name} {pct:.2f}%" for name, pct in results[n].items()), flush=True)
    text = report(results, peer, base)
    print()
    print(text)
    folder = args.out or run_dir("idle")
    out = results_of(results, peer, base, args)
    out.write(folder)
    (folder / "idle.md").write_text(text + "\n")
    print(f"results: {folder}")
    return 0 if out.passed is not False else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
