"""Python bytecode instructions per request in the gateway's request tasks: an A/B that load cannot move.

    python -m loadtests.bench.opcodes [--requests 300] [--mode nonstream|stream] [--against DIR ...] [--top 30]
                                      [--quick] [--out DIR]

Instruction counts under callgrind (loadtests.bench.instructions) also count what runs on timers — health checks,
scrapes, the capacity signal — whose share per request grows with how long the run takes, so on a loaded machine two
runs of one checkout differ by several per cent. Here each checkout's gateway (run from its own directory, in front
of the same two `--instant` simulated replicas as bench_instructions, same config and bodies) counts the bytecode
instructions it executes per function (`sys.settrace` with opcode events, switched on after 200 warm-up requests),
keyed by the asyncio task they ran in; the tasks that serve requests (uvicorn's `RequestResponseCycle.run_asgi`) are
the per-request cost, and they repeat to a few instructions whatever else runs. C code (the HTTP parsers, orjson,
the kernel) is not counted: read it beside bench_instructions, not instead of it. Prints, per checkout, the opcodes
per request in request tasks and in each timer task, and the functions whose count differs most from the first
checkout's; `results.json` in `--out` (loadtests/lib/results.py): each checkout's opcodes per request in request
tasks beside this one's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: this file also runs as the traced gateway's script (`--serve-traced`)
    from loadtests.lib.results import Results

REQUEST_TASK = "RequestResponseCycle.run_asgi"


def _serve_traced(argv: list[str]) -> None:
    """In the checkout's directory: `python -m gateway.cli serve ...`; SIGUSR1 starts counting, SIGUSR2 writes the
    counts to $M3GATE_OPCODES_OUT."""
    import runpy

    sys.path[0] = os.getcwd()  # the checkout's packages, not this file's folder
    counts: collections.Counter[str] = collections.Counter()
    root = re.escape(os.getcwd().rstrip("/") + "/")

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        code = frame.f_code
        name = code.co_name
        if code.co_filename == "<string>" and "self" in frame.f_locals:  # a dataclass's generated __init__
            name = f"{type(frame.f_locals['self']).__name__}.{name}"
        try:
            task = asyncio.current_task()
            kind = "-" if task is None else task.get_coro().__qualname__
        except RuntimeError:
            kind = "-"
        key = f"{kind}|{re.sub(root, '', code.co_filename)}:{name}"

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[key] += 1
            return local

        return local

    def start(*_: Any) -> None:
        sys.settrace(trace)

    def stop(*_: Any) -> None:
        sys.settrace(None)
        Path(os.environ["M3GATE_OPCODES_OUT"]).write_text(json.dumps(counts))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["gateway.cli", *argv]
    runpy.run_module("gateway.cli", run_name="__main__", alter_sys=True)


def count(checkout: Path, urls: list[str], requests: int, stream: bool) -> dict[str, float]:
    """Opcodes per request of `checkout`'s gateway, per "task|file:function"."""
    import httpx
    import yaml

    from gateway.cli.launcher import free_port
    from loadtests.bench.instructions import WARMUP, _send
    from loadtests.bench.overhead import chat_body
    from loadtests.lib.replicas import bench_config

    folder = Path(tempfile.mkdtemp(prefix="m3gate-opcodes-"))
    config = folder / "pools.yaml"
    config.write_text(yaml.safe_dump(bench_config(urls), sort_keys=False))
    out = folder / "counts.json"
    port = free_port()
    with open(folder / "gateway.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-traced", "serve", "--config", str(config),
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=checkout, env={**os.environ, "M3GATE_OPCODES_OUT": str(out)}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway of {checkout} did not start: {(folder / 'gateway.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        body = chat_body(64 if stream else 16, stream)
        asyncio.run(_send(url, body, WARMUP))
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.2)
        asyncio.run(_send(url, body, requests))
        os.kill(proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return {key: n / requests for key, n in json.loads(out.read_text()).items()}
    finally:
        proc.terminate()
        proc.wait(30)


def by_task(counts: dict[str, float]) -> dict[str, float]:
    tasks: collections.Counter[str] = collections.Counter()
    for key, n in counts.items():
        tasks[key.split("|", 1)[0]] += n
    return dict(tasks)


def results_of(results: dict[Path, dict[str, float]], checkouts: list[Path], args: argparse.Namespace) -> Results:
    """Each checkout's opcodes per request in request tasks beside the first's, in the one results format."""
    from loadtests.lib.results import Results

    out = Results("opcodes", vars(args), reference=f"this checkout ({checkouts[0].name}), same run")
    first = by_task(results[checkouts[0]]).get(REQUEST_TASK)
    for checkout in checkouts:
        beside = {} if checkout == checkouts[0] else {"reference": checkouts[0].name, "reference_value": first}
        out.add(f"{args.mode}: {checkout.name}", by_task(results[checkout]).get(REQUEST_TASK), "opcodes/request",
                **beside)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.opcodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--mode", choices=("nonstream", "stream"), default="nonstream")
    parser.add_argument("--against", action="append", default=[], help="another checkout (e.g. a git worktree)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="100 requests (make bench)")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-opcodes)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 100
    from loadtests.lib.replicas import sim_pool

    checkouts = [Path.cwd(), *(Path(p).resolve() for p in args.against)]
    results = {}
    with sim_pool(2, 8192, ["--instant", "--max-num-seqs", "1024"]) as pool:
        for checkout in checkouts:
            results[checkout] = count(checkout, pool.urls, args.requests, args.mode == "stream")
    first = results[checkouts[0]]
    print(f"| checkout | opcodes per {args.mode} request (request tasks) | × {checkouts[0].name} | timers |")
    print("|---|---|---|---|")
    for checkout in checkouts:
        tasks = by_task(results[checkout])
        timers = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(tasks.items(), key=lambda kv: -kv[1])
                           if k != REQUEST_TASK and v >= 50)
        mine = tasks.get(REQUEST_TASK, 0.0)
        print(f"| {checkout} | {mine:,.0f} | {mine / max(1.0, by_task(first).get(REQUEST_TASK, 1.0)):.3f} | {timers} |")
    for checkout in checkouts[1:]:
        other = results[checkout]
        keys = [k for k in set(first) | set(other) if k.startswith(REQUEST_TASK + "|")]
        keys.sort(key=lambda k: -abs(first.get(k, 0.0) - other.get(k, 0.0)))
        print(f"\nrequest tasks, {checkouts[0].name} − {checkout.name} (opcodes per request):")
        for key in keys[:args.top]:
            print(f"  {first.get(key, 0.0) - other.get(key, 0.0):+8.0f}  {key.split('|', 1)[1]}")
    from loadtests.lib.harness import run_dir

    folder = args.out or run_dir("opcodes")
    results_of(results, checkouts, args).write(folder)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-traced":
        _serve_traced(sys.argv[2:])
    else:
        raise SystemExit(main())
