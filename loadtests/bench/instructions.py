"""The gateway's machine instructions per request, counted by valgrind (callgrind): an A/B that noise cannot move.

    python -m loadtests.bench.instructions [--requests 1000] [--modes nonstream,stream] [--against DIR ...] [--out DIR]
                                           [--quick]

CPU seconds per request (loadtests.bench.overhead) move by ±10% between runs on a small shared machine; instruction
counts repeat to within a fraction of a percent whatever else runs, so a change of a few µs per request shows. For
each checkout (this one, then every `--against DIR`, e.g. a `git worktree` of the commit before), the gateway is
started under `valgrind --tool=callgrind` in front of two `--instant` simulated replicas (the ones
loadtests.bench.overhead uses, same config), sent 200 warm-up requests, its counters zeroed (`callgrind_control -z`),
sent `--requests` more (16 at a time, over HTTP/1.1 keep-alive) and its counters dumped: instructions / requests is
the gateway's whole cost per request (event loop, HTTP server and client, m3gate), at startup-free steady state. The
bodies are bench_overhead's (a 12-word chat; max_tokens 16, or 64 streamed SSE events with usage). A checkout is run
with this checkout's virtualenv, from its own directory (so its own `gateway` package is imported).

Under valgrind the gateway runs ~50× slower: 1,000 requests take about a minute per checkout and mode. results.json
in `--out` (loadtests/lib/results.py): each checkout's instructions per request beside this one's.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from gateway.cli.launcher import free_port
from loadtests.bench.overhead import chat_body
from loadtests.lib.harness import run_dir
from loadtests.lib.replicas import bench_config, sim_pool
from loadtests.lib.results import Results

WARMUP = 200
CONCURRENCY = 16


async def _send(url: str, body: dict, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one() -> None:
            async with gate:
                resp = await client.post("/v1/chat/completions", json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"gateway answered {resp.status_code}: {resp.text[:300]}")

        await asyncio.gather(*(one() for _ in range(count)))


def _total(path: str) -> int:
    for line in open(path, errors="replace"):
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def count(checkout: Path, urls: list[str], requests: int, stream: bool) -> int:
    """Instructions the gateway of `checkout` executed for `requests` requests after the warm-up."""
    folder = Path(tempfile.mkdtemp(prefix="m3gate-instr-"))
    config = folder / "pools.yaml"
    config.write_text(yaml.safe_dump(bench_config(urls), sort_keys=False))
    port = free_port()
    out = folder / "callgrind.out"
    log = open(folder / "gateway.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m", "gateway.cli", "serve",
         "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
        cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway of {checkout} did not start: {(folder / 'gateway.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        body = chat_body(64 if stream else 16, stream)
        asyncio.run(_send(url, body, WARMUP))
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        asyncio.run(_send(url, body, requests))
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        dumps = sorted(glob.glob(f"{out}.*"))  # the dump after zeroing: callgrind.out.1
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        return _total(dumps[0])
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.instructions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--modes", default="nonstream,stream")
    parser.add_argument("--against", action="append", default=[], help="another checkout (e.g. a git worktree)")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-instructions)")
    parser.add_argument("--quick", action="store_true", help="300 requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 300
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed: apt-get install valgrind")
        return 2
    checkouts = [Path.cwd(), *(Path(p).resolve() for p in args.against)]
    modes = [m for m in args.modes.split(",") if m]
    results: dict[tuple[str, str], int] = {}
    with sim_pool(2, 8192, ["--instant", "--max-num-seqs", "1024"]) as pool:
        for mode in modes:
            for checkout in checkouts:
                results[(mode, str(checkout))] = count(checkout, pool.urls, args.requests, mode == "stream")
                print(f"{mode:9s} {checkout}: {results[(mode, str(checkout))] / args.requests:,.0f} instructions/request",
                      flush=True)
    print(f"\n| mode | checkout | instructions / request | × {checkouts[0].name} |\n|---|---|---|---|")
    for mode in modes:
        first = results[(mode, str(checkouts[0]))]
        for checkout in checkouts:
            value = results[(mode, str(checkout))]
            print(f"| {mode} | {checkout} | {value / args.requests:,.0f} | {value / first:.3f} |")
    folder = args.out or run_dir("instructions")
    out = Results("instructions", vars(args), reference=f"this checkout ({checkouts[0].name}), same run")
    for mode in modes:
        first = results[(mode, str(checkouts[0]))] / args.requests
        for checkout in checkouts:
            beside = {} if checkout == checkouts[0] else {"reference": checkouts[0].name, "reference_value": first}
            out.add(f"{mode}: {checkout.name}", results[(mode, str(checkout))] / args.requests,
                    "instructions/request", **beside)
    out.write(folder)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
