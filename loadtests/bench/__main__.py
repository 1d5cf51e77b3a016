"""`make bench`: a short version of every benchmark, results under loadtests/results/, a summary table at the end.

    python -m loadtests.bench [--quick] [--skip NAME ...]

1. harness self-check: the `smoke` workload through a gateway in front of 2 simulated replicas (report + plots);
2. gateway overhead (loadtests.bench.overhead);
3. routing policies on the agent trace (loadtests.bench.policies);
4. the other engineers' hot-path benchmarks when their modules exist (bench_classify, bench_routing, bench_ui), with `--quick`
   when they offer it, else small arguments, each with a time limit.

Each part runs as its own process with a timeout, so one failure or hang does not stop the rest. `--quick` (what
`make bench` uses) keeps the whole under about five minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.lib.harness import run_dir

# other engineers' benches: (module, quick arguments when it has no --quick flag, timeout s)
OTHERS: list[tuple[str, list[str], int]] = [
    ("loadtests.bench.classify", ["--sizes", "1000,32000,128000", "--requests", "2", "--repeats", "5"], 90),
    ("loadtests.bench.routing", ["--iterations", "3000", "--rounds", "1"], 90),
    ("loadtests.bench.ui", ["--refreshes", "200", "--requests", "30"], 120),
]
OWN = ("harness", "overhead", "policies")


def _exists(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _has_quick(module: str) -> bool:
    try:
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return "--quick" in out.stdout


def _run(name: str, cmd: list[str], timeout: int, log: Path) -> dict[str, Any]:
    print(f"\n=== {name}: {' '.join(cmd[2:] if cmd[:2] == [sys.executable, '-m'] else cmd)} (limit {timeout} s)",
          flush=True)
    t = time.monotonic()
    with open(log, "w") as f:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            assert proc.stdout is not None
            deadline = time.monotonic() + timeout
            lines: list[str] = []
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                if not sel.select(timeout=min(1.0, left)):
                    if proc.poll() is not None:
                        break
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                f.write(line)
                lines.append(line)
                sys.stdout.write(line)
                sys.stdout.flush()
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the bench and the processes it started
            proc.wait()
            return {"name": name, "rc": None, "status": "TIMEOUT", "seconds": time.monotonic() - t,
                    "output": "".join(lines), "log": str(log)}
    status = "ok" if rc == 0 else f"exit {rc}"
    return {"name": name, "rc": rc, "status": status, "seconds": time.monotonic() - t, "output": "".join(lines),
            "log": str(log)}


def _pass_fail(output: str) -> tuple[int, int]:
    return (len(re.findall(r"^PASS\b", output, re.M)), len(re.findall(r"^FAIL\b", output, re.M)))


def _key_lines(name: str, output: str) -> str:
    """A one-line result for the summary table."""
    if name == "harness":
        m = re.search(r"\*\*overall\*\* \| (\d+) \| (\d+) \| (\d+) \|", output)
        hit = re.search(r"/metrics: ([\d.]+%)", output)
        return (f"{m.group(2)}/{m.group(1)} ok, cache hit {hit.group(1) if hit else '?'}" if m else "no report")
    if name == "overhead":
        parts = []
        for pat, label in ((r"added latency p50 ≤ 1 ms at c=32 \(non-stream\): ([-\d.]+ ms)", "added p50 c=32"),
                           (r"added latency p99 ≤ 3 ms at c=32 \(non-stream\): ([-\d.]+ ms)", "p99"),
                           (r"per gateway core \(non-stream, c=32\): (\d+) req/CPU-s", "req/CPU-s"),
                           (r"\(paced, c=64\): (\d+) events/CPU-s", "events/CPU-s"),
                           (r"open, peak RSS (\d+ MiB)", "RSS")):
            m = re.search(pat, output)
            if m:
                parts.append(f"{label} {m.group(1)}")
        return ", ".join(parts)
    if name == "policies":
        parts = []
        for mode in ("round_robin", "least_loaded", "prefix_affinity", "direct"):
            m = re.search(rf"^\| {mode} \| ([\d.]+%) \| [^|]+\| [\d.]+ / ([\d.]+) /", output, re.M)
            if m:
                parts.append(f"{mode} hit {m.group(1)} TTFT p95 {m.group(2)} ms")
        return "; ".join(parts)
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return (lines[-1][:140] if lines else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short version (make bench)")
    parser.add_argument("--skip", nargs="*", default=[], help="parts to skip: harness overhead policies others")
    args = parser.parse_args(argv)
    folder = run_dir("bench")
    folder.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m"]
    quick = ["--quick"] if args.quick else []
    plan: list[tuple[str, list[str], int]] = []
    if "harness" not in args.skip:
        plan.append(("harness", [*py, "loadtests", "run", "smoke", "--sims", "2", "--sim-args", "--speed 20",
                                 "--out", str(folder / "smoke"), "--progress" if sys.stderr.isatty() else
                                 "--no-progress"], 90))
    if "overhead" not in args.skip:
        plan.append(("overhead", [*py, "loadtests.bench.overhead", *quick, "--no-profile", "--out",
                                  str(folder / "overhead")], 200 if args.quick else 900))
    if "policies" not in args.skip:
        plan.append(("policies", [*py, "loadtests.bench.policies", *quick, "--out", str(folder / "policies")],
                     240 if args.quick else 1800))
    if "others" not in args.skip:
        for module, fallback, limit in OTHERS:
            if _exists(module):
                extra = ["--quick"] if _has_quick(module) else fallback
                plan.append((module.split(".")[-1], [*py, module, *(extra if args.quick else [])], limit))
    results = []
    t0 = time.monotonic()
    for name, cmd, limit in plan:
        results.append(_run(name, cmd, limit, folder / f"{name}.log"))
    total = time.monotonic() - t0
    rows = []
    for r in results:
        passed, failed = _pass_fail(r["output"])
        if r["rc"] == 1 and "Traceback (most recent call last)" in r["output"]:
            r["status"] = "crashed"
        elif r["rc"] == 1 and failed:
            r["status"] = "ran (targets missed)"
        rows.append({"bench": r["name"], "status": r["status"], "seconds": round(r["seconds"], 1),
                     "pass": passed, "fail": failed, "result": _key_lines(r["name"], r["output"]), "log": r["log"]})
    (folder / "summary.json").write_text(json.dumps({"total_s": total, "rows": rows}, indent=2))
    lines = ["", f"## make bench summary ({total:.0f} s; results in {folder})", "",
             "| bench | status | s | checks PASS/FAIL | result |", "|---|---|---|---|---|"]
    for row in rows:
        checks = f"{row['pass']}/{row['fail']}" if row["pass"] or row["fail"] else "–"
        lines.append(f"| {row['bench']} | {row['status']} | {row['seconds']:.0f} | {checks} | {row['result']} |")
    text = "\n".join(lines) + "\n"
    (folder / "summary.md").write_text(text)
    print(text)
    # a benchmark that crashed or hung fails `make bench`; missed targets are results, shown in the table
    broken = [r for r in rows if r["bench"] in OWN and r["status"] not in ("ok", "ran (targets missed)")]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
