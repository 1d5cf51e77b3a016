"""How long replica choice takes on the gateway's hot path, for an 8K-token chat over 4 and 16 replicas.

`python -m loadtests.bench.routing` times, per request:

- `choose`: the policy's decision alone, given the request's block hashes (target: ≤ 100 µs p99);
- `choose+dispatched`: plus recording the blocks in the prefix index and the session, as the gateway does;
- `prefix_blocks`: rendering and hashing the request body alone;
- `total`: all of the above, what routing adds to a request.

The prefix index is warmed to capacity first (each replica holding many agent sessions that share a few system
prompts), so lookups meet a full hash map and LRU eviction runs on every record, as in steady state. prefix_affinity
is built as the gateway builds it: with the pool's TTFT calibrator when the code has one (policies.latency_model).

`--against DIR` is a same-run A/B against another checkout of the code (e.g. a `git worktree` of an older commit):
this script runs alternately in subprocesses importing this tree's and DIR's `policies`/`pools`, `--repeats` times
each, and prints the medians of each step's p50/p99 and their ratios (this tree ÷ DIR).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import string
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from policies.prefix import prefix_blocks
from policies.replica_choice import (
    PolicyName,
    PrefixAffinity,
    ReplicaPolicy,
    ReplicaSnapshot,
    RoutingRequest,
    build_policy,
)
from pools.prefix_index import PrefixIndex

MODEL = "MiniMaxAI/MiniMax-M3"
POLICIES: tuple[PolicyName, ...] = ("prefix_affinity", "least_loaded", "round_robin")


def _text(rnd: random.Random, n_chars: int) -> str:
    words = ["".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(2, 9))) for _ in range(2000)]
    out: list[str] = []
    size = 0
    while size < n_chars:
        word = rnd.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_chars]


def make_bodies(count: int, prompt_tokens: int, seed: int = 1) -> list[dict[str, Any]]:
    """Agent-like chats of ~prompt_tokens tokens (4 bytes each): one of 8 system prompts, tools, a few turns."""
    rnd = random.Random(seed)
    systems = [_text(rnd, 6000) for _ in range(8)]
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": _text(rnd, 99), "parameters": parameters}}
        for i in range(6)
    ]
    rest = prompt_tokens * 4 - 6000 - 1500
    bodies = []
    for i in range(count):
        turns = [
            {"role": "user", "content": _text(rnd, rest // 3)},
            {"role": "assistant", "content": _text(rnd, rest // 3)},
            {"role": "user", "content": _text(rnd, rest - 2 * (rest // 3))},
        ]
        bodies.append({"model": MODEL, "messages": [{"role": "system", "content": systems[i % 8]}, *turns],
                       "tools": tools, "user": f"session-{i % 200}"})  # fmt: skip
    return bodies


def make_snapshots(replicas: int, rnd: random.Random) -> list[ReplicaSnapshot]:
    """A moderately busy pool with fresh metrics."""
    snaps = []
    for i in range(replicas):
        in_flight = rnd.randint(0, 24)
        running = float(min(in_flight, 16))
        snaps.append(
            ReplicaSnapshot(
                url=f"http://10.0.{i // 250}.{i % 250 + 1}:8000",
                pool="default",
                in_flight=in_flight,
                in_flight_tokens=in_flight * rnd.randint(4000, 12000),
                waiting=float(max(0, in_flight - 16)),
                running=running,
                kv_usage=rnd.uniform(0.2, 0.9),
                metrics_age_s=rnd.uniform(0.0, 2.0),
                kv_blocks=16_384,
            )
        )
    return snaps


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(step: Callable[[int], object], iterations: int) -> list[float]:
    clock = time.perf_counter_ns
    samples = []
    for i in range(iterations):
        start = clock()
        step(i)
        samples.append((clock() - start) / 1000.0)
    return samples


def bench(
    policy_name: PolicyName, replicas: int, iterations: int, prompt_tokens: int, rounds: int = 3, seed: int = 7
) -> dict[str, Any]:
    rnd = random.Random(seed)
    bodies = make_bodies(64, prompt_tokens)
    hashes = [prefix_blocks(b, "chat", MODEL) for b in bodies]
    index = PrefixIndex()
    kwargs: dict[str, Any] = {"prefix_index": index}  # only prefix_affinity reads the index
    calibrator = _calibrator()
    if calibrator is not None and policy_name == "prefix_affinity":
        kwargs["calibrator"] = calibrator  # as gateway/runtime.py builds it
    policy: ReplicaPolicy = build_policy(policy_name, **kwargs)
    snapshot_sets = [make_snapshots(replicas, rnd) for _ in range(16)]
    for snap in snapshot_sets[0]:
        index.resize(snap.url, snap.kv_blocks)
    # warm the index to capacity: other sessions' blocks everywhere, and our bodies' prefixes on some replicas
    for n in range(replicas * 16_384 // 64 + 64):
        filler = tuple(rnd.getrandbits(64) for _ in range(64))
        index.record(snapshot_sets[0][n % replicas].url, filler, now=0.0)
    for i, h in enumerate(hashes):
        index.record(snapshot_sets[0][i % replicas].url, h, now=1.0)

    requests = [
        RoutingRequest(prompt_tokens, 2048, h, session_key=b["user"]) for h, b in zip(hashes, bodies, strict=True)
    ]

    def choose(i: int) -> object:
        return policy.choose(requests[i % 64], snapshot_sets[i % 16], 2.0 + i)

    def choose_dispatch(i: int) -> object:
        request = requests[i % 64]
        decision = policy.choose(request, snapshot_sets[i % 16], 2.0 + i)
        policy.dispatched(request, decision.replica, 2.0 + i)
        return decision

    def hashing(i: int) -> object:
        return prefix_blocks(bodies[i % 64], "chat", MODEL)

    def total(i: int) -> object:
        body = bodies[i % 64]
        request = RoutingRequest(prompt_tokens, 2048, prefix_blocks(body, "chat", MODEL), session_key=body["user"])
        decision = policy.choose(request, snapshot_sets[i % 16], 2.0 + i)
        policy.dispatched(request, decision.replica, 2.0 + i)
        return decision

    result: dict[str, Any] = {"policy": policy_name, "replicas": replicas, "prompt_tokens": prompt_tokens,
                              "blocks": len(hashes[0]), "iterations": iterations}  # fmt: skip
    reasons: dict[str, int] = {}
    for i in range(min(iterations, 2000)):
        reason = policy.choose(requests[i % 64], snapshot_sets[i % 16], 2.0 + i).reason
        reasons[reason] = reasons.get(reason, 0) + 1
    result["reasons"] = reasons
    result["calibrated"] = calibrator is not None
    for name, step in (("choose", choose), ("choose+dispatched", choose_dispatch), ("prefix_blocks", hashing),
                       ("total", total)):  # fmt: skip
        _timed(step, min(iterations // 10, 1000))  # warm-up
        # On a shared machine other processes steal the CPU now and then; of `rounds` rounds, keep the quietest.
        runs = [_timed(step, max(1, iterations // rounds)) for _ in range(rounds)]
        samples = min(runs, key=lambda run: percentile(run, 0.99))
        result[name] = {
            "p50_us": round(statistics.median(samples), 1),
            "p99_us": round(percentile(samples, 0.99), 1),
            "p99_worst_round_us": round(max(percentile(run, 0.99) for run in runs), 1),
            "mean_us": round(statistics.fmean(samples), 1),
        }
    return result


def _calibrator() -> Any:
    """The pool's TTFT calibrator, when this checkout of the code has one (it came with the prediction work)."""
    if "calibrator" not in inspect.signature(PrefixAffinity.__init__).parameters:
        return None
    from policies.latency_model import TtftCalibrator

    return TtftCalibrator()


STEPS = ("choose", "choose+dispatched", "prefix_blocks", "total")


def against(other: Path, args: argparse.Namespace) -> int:
    """Same-run A/B: this file, run alternately with this tree's code and with `other`'s on sys.path first."""
    here = Path(__file__).resolve().parents[2]
    trees = {"new": here, "old": other.resolve()}
    script = Path(__file__).resolve()
    out: dict[str, dict[tuple[int, str], list[dict[str, float]]]] = {"new": {}, "old": {}}
    for rep in range(args.repeats):
        for label in (("new", "old") if rep % 2 == 0 else ("old", "new")):
            env = {**os.environ, "PYTHONPATH": str(trees[label])}
            cmd = [sys.executable, "-P", str(script), "--json", "--policies", "prefix_affinity", "--iterations",
                   str(args.iterations), "--rounds", str(args.rounds), "--prompt-tokens", str(args.prompt_tokens),
                   "--replicas", *map(str, args.replicas)]
            proc = subprocess.run(cmd, env=env, cwd=trees[label], capture_output=True, text=True, check=True)
            for line in proc.stdout.splitlines():
                row = json.loads(line)
                for step in STEPS:
                    out[label].setdefault((row["replicas"], step), []).append(row[step])
                if rep == 0:
                    print(f"  {label} ({trees[label]}, calibrator {row.get('calibrated')}): {row['replicas']} "
                          f"replicas, reasons {row['reasons']}", flush=True)
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
    print(f"\nprefix_affinity, {args.prompt_tokens}-token prompt, medians of {args.repeats} repeats (each the quietest "
          f"of {args.rounds} rounds), new = {here}, old = {other}")
    print(f"{'replicas':>8} {'step':<18} {'new p50/p99 µs':>18} {'old p50/p99 µs':>18} {'ratio p50 / p99':>16}   "
          "per-repeat p50 ratios")
    worst = 0.0
    result = []
    for replicas in args.replicas:
        for step in STEPS:
            new, old = out["new"][(replicas, step)], out["old"][(replicas, step)]
            n50, n99 = statistics.median(r["p50_us"] for r in new), statistics.median(r["p99_us"] for r in new)
            o50, o99 = statistics.median(r["p50_us"] for r in old), statistics.median(r["p99_us"] for r in old)
            per = [a["p50_us"] / b["p50_us"] for a, b in zip(new, old, strict=True)]
            if step == "choose":
                worst = max(worst, n50 / o50)
            result.append({"replicas": replicas, "step": step, "new_p50_us": n50, "new_p99_us": n99,
                           "old_p50_us": o50, "old_p99_us": o99, "ratio_p50": n50 / o50, "ratio_p99": n99 / o99,
                           "per_repeat_ratio_p50": per})
            print(f"{replicas:>8} {step:<18} {n50:>8.1f} / {n99:<8.1f} {o50:>8.1f} / {o99:<8.1f} "
                  f"{n50 / o50:>7.2f} / {n99 / o99:<7.2f}   {', '.join(f'{x:.2f}' for x in per)}")
    ok = worst <= 1.5
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "against.json").write_text(json.dumps({"against": str(other), "repeats": args.repeats,
                                                                 "rows": result}, indent=2))
        from loadtests.lib.results import Results

        results = Results("routing", vars(args), reference=f"the same steps with {other}'s code, same run")
        for row in result:
            results.add(f"{row['step']} p50, {row['replicas']} replicas", row["new_p50_us"], "µs",
                        reference=str(other.name), reference_value=row["old_p50_us"])
        results.add("choose p50 this ÷ other, worst replica count", worst, "×", at_most=1.5)
        results.write(Path(args.out))
    print(f"{'PASS' if ok else 'FAIL'}  choose p50 new ÷ old ≤ 1.5 at every replica count: worst {worst:.2f}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="split the iterations into rounds; report the quietest")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="A/B against another checkout (e.g. `git worktree add ../base COMMIT`): prefix_affinity "
                             "only, alternating subprocesses, ratios new ÷ old")
    parser.add_argument("--repeats", type=int, default=5, help="with --against: runs of each side, alternated")
    parser.add_argument("--quick", action="store_true", help="a short run: 3,000 iterations, one round")
    parser.add_argument("--out", help="results folder: results.json (with --against also against.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations, args.rounds = 3000, 1
    if args.against is not None:
        sys.exit(against(args.against, args))
    rows = []

    steps = STEPS
    if not args.json:
        print(f"{'policy':<16} {'replicas':>8} " + " ".join(f"{s + ' p50/p99 µs':>28}" for s in steps))
    for policy_name in args.policies:
        for replicas in args.replicas:
            result = bench(policy_name, replicas, args.iterations, args.prompt_tokens, args.rounds)
            rows.append((policy_name, replicas, result))
            if args.json:
                print(json.dumps(result))
            else:
                cells = " ".join(f"{result[s]['p50_us']:>13.1f} / {result[s]['p99_us']:<12.1f}" for s in steps)
                print(f"{policy_name:<16} {replicas:>8} {cells}   reasons={result['reasons']}")
    if args.out:
        print(f"results: {write_results(rows, args)}")


def write_results(rows: list[tuple[str, int, dict[str, Any]]], args: argparse.Namespace) -> Path:
    """results.json (imported here: the --against subprocesses run this file on another checkout's code)."""
    from loadtests.lib.results import Results

    results = Results("routing", vars(args), reference="none: each step's own time on this machine")
    for policy_name, replicas, result in rows:
        results.add(f"{policy_name} choose p99, {replicas} replicas", result["choose"]["p99_us"], "µs", at_most=100)
        results.add(f"{policy_name} total p50, {replicas} replicas", result["total"]["p50_us"], "µs")
    return results.write(Path(args.out))


if __name__ == "__main__":
    main()
