"""What the session store costs: memory for many open sessions, and CPU per request.

`python -m loadtests.bench.sessions [--sessions 100000] [--turns 4] [--iterations 200000] [--quick] [--out DIR]`
prints (and writes results.json, loadtests/lib/results.py):

- memory: `--sessions` open sessions, each after `--turns` turns with 2 tool calls per answer and a history key per
  turn (uuid4 session ids, the default key bounds), measured with tracemalloc (what the store allocated and keeps)
  and as the RSS delta; target < 150 MiB for 100k sessions;
- per request, resolve + begin_turn + end_turn, p50/p99 over `--iterations` requests against that full store, for an
  explicit id, a tool-call id, a history key and a new session; target p50 ≤ 10 µs;
- the request-side helpers of policies/sessions.py on a 20-message chat (identify, tool_result_ids, turn_kind,
  history_keys) and SseToolCallScanner.feed per chunk of a text stream (the relay's cost when no tool is called).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from policies.sessions import SessionIdentity, SseToolCallScanner, history_keys, identify, tool_result_ids, turn_kind
from pools.sessions import SessionStore

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(name: str, samples_us: list[float]) -> dict[str, Any]:
    row = {"name": name, "n": len(samples_us), "p50_us": round(_pct(samples_us, 0.5), 3),
           "p99_us": round(_pct(samples_us, 0.99), 3), "mean_us": round(statistics.fmean(samples_us), 3)}
    print(f"{name:<40} n={row['n']:>7}  p50={row['p50_us']:>8.3f} µs  p99={row['p99_us']:>8.3f} µs  "
          f"mean={row['mean_us']:>8.3f} µs")
    return row


class _Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


_TOKENS = (12000, 300, 11000)  # (prompt, completion, cached) of each answer's usage


def _fill(store: SessionStore, clock: _Clock, sessions: int, turns: int) -> list[str]:
    """`sessions` sessions with explicit uuid ids, `turns` turns each (2 tool calls per answer, a history key)."""
    ids = []
    key = 1
    for _ in range(sessions):
        session_id = str(uuid.uuid4())
        ids.append(session_id)
        session, _ = store.resolve(SessionIdentity(session_id, "header"), (), None, clock.now)
        for t in range(turns):
            clock.now += 0.001
            turn = store.begin_turn(session, "tool_result" if t else "first", clock.now)
            clock.now += 0.001
            store.end_turn(turn, clock.now, (f"call_{key:024x}", f"call_{key + 1:024x}"), key, _TOKENS)
            key += 2
    return ids


def _top_up(store: SessionStore) -> None:
    """Fill both remembered-key maps to their worst case (both generations full), so the figure is the bound."""
    for keys in (store._by_tool, store._by_history):
        session_id = next(iter(store._open))
        key = 1 << 50
        while len(keys._new) < keys._half - 1:
            keys.put(key, session_id)
            key += 1


def _build(sessions: int, turns: int) -> SessionStore:
    clock = _Clock()
    store = SessionStore(max_sessions=max(sessions, 1), clock=clock)
    _fill(store, clock, sessions, turns)
    _top_up(store)
    return store


def bench_memory(sessions: int, turns: int) -> dict[str, Any]:
    gc.collect()
    rss0 = _rss()
    store = _build(sessions, turns)
    gc.collect()
    rss = _rss() - rss0
    del store
    gc.collect()
    tracemalloc.start()
    store = _build(sessions, turns)
    gc.collect()
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out = {"sessions": len(store), "turns_each": turns, "tool_keys": len(store._by_tool),
           "history_keys": len(store._by_history), "traced_mib": round(traced / MiB, 1),
           "rss_delta_mib": round(rss / MiB, 1), "bytes_per_session": round(traced / max(1, sessions))}
    print(f"memory: {out['sessions']} open sessions × {turns} turns, {out['tool_keys']} tool-call keys, "
          f"{out['history_keys']} history keys (both at their bound): tracemalloc {out['traced_mib']} MiB "
          f"({out['bytes_per_session']} B/session); RSS delta {out['rss_delta_mib']} MiB (a separate run without "
          "tracemalloc; includes the freed key generations pymalloc keeps)")
    return out


def bench_requests(sessions: int, iterations: int) -> list[dict[str, Any]]:
    clock = _Clock()
    store = SessionStore(max_sessions=sessions, clock=clock)
    ids = _fill(store, clock, sessions, 2)
    rows = []
    key = 1 << 40
    perf = time.perf_counter_ns

    def run(name: str, one: Callable[[int], None]) -> None:
        samples = []
        gc.collect()
        gc.disable()
        try:
            for i in range(iterations):
                t0 = perf()
                one(i)
                samples.append((perf() - t0) / 1000)
        finally:
            gc.enable()
        rows.append(_row(name, samples))

    identities = [SessionIdentity(i, "header") for i in ids]
    n = len(ids)

    no_id = SessionIdentity()

    def scenario(identity: Callable[[int], SessionIdentity], kind: str, *, found_by_tool: bool = False,
                 found_by_history: bool = False, asks_tools: bool = False) -> Callable[[int], None]:
        """One turn: resolved by its id, by the previous iteration's tool-call ids or history key, or new."""

        def one(i: int) -> None:
            nonlocal key
            clock.now += 0.0001
            tool_ids = (f"call_{key:024x}",) if found_by_tool else ()
            session, _ = store.resolve(identity(i), tool_ids, key if found_by_history else None, clock.now)
            turn = store.begin_turn(session, kind, clock.now)
            key += 2
            answer_tools = (f"call_{key:024x}", f"call_{key + 1:024x}") if asks_tools else ()
            store.end_turn(turn, clock.now, answer_tools, key, _TOKENS)

        return one

    run("explicit id: resolve+begin+end", scenario(lambda i: identities[i % n], "tool_result", asks_tools=True))
    run("tool-call id: resolve+begin+end", scenario(lambda i: no_id, "tool_result", found_by_tool=True,
                                                     asks_tools=True))
    run("history key: resolve+begin+end", scenario(lambda i: no_id, "user", found_by_history=True))
    run("new session (evicting): resolve+begin+end", scenario(lambda i: no_id, "first"))
    return rows


def bench_helpers(iterations: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 50}]
    for i in range(6):
        messages.append({"role": "user", "content": f"step {i}: " + "please look at the code " * 20})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": "def f():\n    return 1\n" * 30})
    body = {"model": "m", "messages": messages[:20]}
    headers = {"content-type": "application/json", "x-session-id": "abc"}
    perf = time.perf_counter_ns
    rows = []
    for name, fn in [
        ("identify (header)", lambda: identify(headers, body, "chat")),
        ("identify (nothing)", lambda: identify({}, body, "chat")),
        ("tool_result_ids (20 messages)", lambda: tool_result_ids(body, "chat")),
        ("turn_kind (20 messages)", lambda: turn_kind(body, "chat")),
        (f"history_keys (20 messages, {len(orjson.dumps(body)) // 1024} KiB)", lambda: history_keys(body, "chat")),
    ]:
        samples = []
        for _ in range(max(1000, iterations // 20)):
            t0 = perf()
            fn()
            samples.append((perf() - t0) / 1000)
        rows.append(_row(name, samples))
    chunk = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":' \
            b'{"content":" token"},"finish_reason":null}]}\n\n'
    scanner = SseToolCallScanner("chat")
    samples = []
    for _ in range(iterations):
        t0 = perf()
        scanner.feed(chunk)
        samples.append((perf() - t0) / 1000)
    rows.append(_row("SseToolCallScanner.feed (text chunk)", samples))
    split = [chunk[:70], chunk[70:]]
    samples = []
    for i in range(iterations):
        t0 = perf()
        scanner.feed(split[i & 1])
        samples.append((perf() - t0) / 1000)
    rows.append(_row("SseToolCallScanner.feed (split chunks)", samples))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="20,000 sessions, 20,000 iterations")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-sessions)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.iterations = 20_000, 20_000
    t0 = time.perf_counter_ns()
    overhead = min(-(time.perf_counter_ns() - time.perf_counter_ns()) for _ in range(1000))
    print(f"(perf_counter_ns pair overhead ≈ {overhead / 1000:.3f} µs, included in every figure)")
    results = {"memory": bench_memory(args.sessions, args.turns),
               "requests": bench_requests(args.sessions, args.iterations),
               "helpers": bench_helpers(args.iterations)}
    print(f"total {(time.perf_counter_ns() - t0) / 1e9:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    folder = args.out or run_dir("sessions")
    results_of(results, args).write(folder)
    print(f"results: {folder}")
    return 0


def results_of(results: dict[str, Any], args: argparse.Namespace) -> Results:
    """The targets (< 150 MiB for 100k sessions, i.e. per session; p50 ≤ 10 µs per request) and the helpers'
    costs, in the one results format."""
    out = Results("sessions", vars(args), reference="none: the store's own memory and CPU")
    memory = results["memory"]
    out.add(f"memory per open session ({memory['sessions']:,} sessions, tracemalloc)", memory["bytes_per_session"],
            "B", at_most=150 * MiB / 100_000)
    for row in results["requests"]:
        out.add(f"{row['name']} p50", row["p50_us"], "µs", at_most=10.0)
    for row in results["helpers"]:
        out.add(f"{row['name']} p50", row["p50_us"], "µs")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
