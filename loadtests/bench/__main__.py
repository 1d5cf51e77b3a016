"""`make bench`: a short version of every benchmark, each writing its results.json (loadtests/lib/results.py), and
one table read from those files at the end.

    python -m loadtests.bench [--quick] [--skip NAME ...] [--limit-factor F]
    python -m loadtests.bench --list            every benchmark in loadtests/bench/, one line each

1. harness self-check: the `smoke` workload through a gateway in front of 2 simulated replicas (report + plots);
2. gateway overhead (loadtests.bench.overhead);
3. routing policies on the agent trace (loadtests.bench.policies);
4. the hot-path benchmarks: the gateway's pure steps (loadtests.bench.hotpath), classification
   (loadtests.bench.classify), replica choice (loadtests.bench.routing), the status page (loadtests.bench.ui).

Each part runs as its own process with `--out <folder>/<part>` and a time limit, so one failure or hang does not stop
the rest. A part's limit (`LIMITS`: its `--quick` and full run's on an idle 2-core machine, with room) is multiplied
by `--limit-factor`, by default the machine's load per core when `make bench` starts (at least 1): the limit is
there to stop a hang, and on a busy machine every part runs longer. `--quick` (what `make bench` uses) keeps the
whole under about five minutes on an idle machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.lib.harness import run_dir
from loadtests.lib.results import FILE, read, table

# each part's time limit on an idle machine, seconds: (with --quick, without)
LIMITS: dict[str, tuple[int, int]] = {"harness": (90, 90), "overhead": (200, 900), "policies": (240, 1800),
                                      "hotpath": (60, 600), "classify": (90, 900), "routing": (90, 900),
                                      "ui": (120, 1200)}
OTHERS = ("hotpath", "classify", "routing", "ui")  # the hot-path benches
OWN = ("harness", "overhead", "policies")


def limit_factor(load: float, cores: int) -> float:
    """How much longer than on an idle machine a part may take: the load per core, at least 1 and at most 8 (the
    limit stops a hang; it does not judge speed, but a hang must still end within a bounded time)."""
    return min(8.0, max(1.0, load / max(1, cores)))


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


def benches() -> list[tuple[str, str]]:
    """Every benchmark module here with the first paragraph of its docstring (one line)."""
    out = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if not path.stem.startswith("_"):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            out.append((path.stem, " ".join(doc.strip().split("\n\n")[0].split())))
    return out


def summary(rows: list[dict[str, Any]], folder: Path, total: float) -> str:
    """One table from the parts' results.json; a part that wrote none (crashed, timed out) gets a row saying so."""
    runs, missing = [], []
    for row in rows:
        path = folder / row["bench"] / FILE
        try:
            runs.append({**read(path), "name": row["bench"]})
        except (OSError, ValueError) as exc:
            missing.append(f"| {row['bench']} | no {FILE} ({row['status']}: {type(exc).__name__}) | | | | |")
    status = ", ".join(f"{r['bench']} {r['status']} {r['seconds']:.0f} s" for r in rows)
    body = table(runs) + ("\n" + "\n".join(missing) if missing else "")
    return f"\n## make bench ({total:.0f} s; results in {folder})\n\n{body}\n\nRuns: {status}\n"


def _plan(args: argparse.Namespace, folder: Path) -> list[tuple[str, list[str], int]]:
    py = [sys.executable, "-m"]
    quick = ["--quick"] if args.quick else []
    commands = {
        "harness": [*py, "loadtests", "run", "smoke", "--sims", "2", "--sim-args", "--speed 20", "--out",
                    str(folder / "harness"), "--progress" if sys.stderr.isatty() else "--no-progress"],
        "overhead": [*py, "loadtests.bench.overhead", *quick, "--no-profile", "--out", str(folder / "overhead")],
        **{name: [*py, f"loadtests.bench.{name}", *quick, "--out", str(folder / name)]
           for name in ("policies", *OTHERS)},
    }
    skipped = set(args.skip) | (set(OTHERS) if "others" in args.skip else set())
    return [(name, cmd, round(LIMITS[name][0 if args.quick else 1] * args.limit_factor))
            for name, cmd in commands.items() if name not in skipped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short version (make bench)")
    parser.add_argument("--skip", nargs="*", default=[], help="parts to skip: harness overhead policies others (or one of them: hotpath classify routing ui)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--limit-factor", type=float, default=None,
                        help="multiply every part's time limit (default: the load per core now, at least 1)")
    args = parser.parse_args(argv)
    if args.limit_factor is None:
        args.limit_factor = limit_factor(os.getloadavg()[0], os.cpu_count() or 1)
    if args.list:
        for name, line in benches():
            print(f"python -m loadtests.bench.{name:18s} {line}")
        return 0
    folder = run_dir("bench")
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.monotonic()
    for name, cmd, limit in _plan(args, folder):
        results.append(_run(name, cmd, limit, folder / f"{name}.log"))
    total = time.monotonic() - t0
    rows = []
    for r in results:
        if r["rc"] == 1 and "Traceback (most recent call last)" in r["output"]:
            r["status"] = "crashed"
        elif r["rc"] == 1:
            r["status"] = "ran (targets missed)"
        rows.append({"bench": r["name"], "status": r["status"], "seconds": round(r["seconds"], 1), "log": r["log"]})
    (folder / "summary.json").write_text(json.dumps({"total_s": total, "rows": rows}, indent=2))
    text = summary(rows, folder, total)
    (folder / "summary.md").write_text(text)
    print(text)
    # a benchmark that crashed or hung fails `make bench`; missed targets are results, shown in the table
    broken = [r for r in rows if r["bench"] in OWN and r["status"] not in ("ok", "ran (targets missed)")]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
