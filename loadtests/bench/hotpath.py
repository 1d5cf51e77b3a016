"""Per-request CPU of the gateway's own pure steps, in-process: µs per call for a typical short chat request.

    python -m loadtests.bench.hotpath [--repeats 7] [--budget-ms 40] [--quick] [--out DIR]

End-to-end CPU figures (loadtests.bench.overhead) are too noisy on a small shared machine to see a step of a few µs
move; this times each step alone with `timeit` (best of `--repeats`, each repeat about `--budget-ms` long) on the
inputs the overhead benchmark sends: a 12-word chat request with max_tokens 16, three pools (32K / 128K / 1M, one
replica each), no API keys. The same request again and again is what that benchmark sends, so its text's count comes
from the tokens cache after the first; the "unseen text" rows cycle through 50,000 different texts instead (what a
new user message costs; earlier turns of a conversation are re-sent, so cached, with every new one). Async steps
that never suspend on this path (`Coordinator.choose_pool` without a recount, `TrafficControl.admit` with a free slot)
are driven by hand, without an event loop."""

from __future__ import annotations

import argparse
import itertools
import timeit
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request

from gateway.access import ANONYMOUS, check_header_size
from gateway.coordinator import Coordinator
from gateway.runtime import Gateway
from gateway.record import RequestRecord
from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from policies.admission import pool_saturated
from policies.classify import classify
from policies.pool_choice import choose_pool
from policies.prefix import prefix_blocks
from policies.traffic import check_input_limits, request_priority, resolve_class, restrict_to_key
from policies.config import GatewayConfig, PoolConfig

BODY = {
    "model": "MiniMaxAI/MiniMax-M3",
    "messages": [{"role": "user", "content": " ".join(["hello"] * 12)}],
    "max_tokens": 16,
}
RAW = orjson.dumps(BODY)
HEADERS = [
    (b"host", b"127.0.0.1:8080"),
    (b"user-agent", b"python-aiohttp/3.11"),
    (b"accept", b"*/*"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"content-type", b"application/json"),
    (b"content-length", str(len(RAW)).encode()),
]
UNSEEN = 50_000


def config() -> GatewayConfig:
    pools = [
        PoolConfig(name="interactive", max_model_len=32_768, endpoints=["http://127.0.0.1:9101"]),
        PoolConfig(name="repository", max_model_len=131_072, endpoints=["http://127.0.0.1:9102"]),
        PoolConfig(name="extended", max_model_len=1_048_576, endpoints=["http://127.0.0.1:9103"]),
    ]
    return GatewayConfig(model="MiniMaxAI/MiniMax-M3", pools=pools)


def _request() -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": HEADERS,
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8080)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": RAW, "more_body": False}

    return Request(scope, receive)


def _words(n_chars: int) -> str:
    """`n_chars` of varied text (~4 characters per token)."""
    words = (f"w{i % 9973}" for i in itertools.count())
    return " ".join(itertools.islice(words, n_chars // 5))[:n_chars]


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive a coroutine that completes without suspending (no event loop needed)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the coroutine suspended: this step is not on the no-wait path")


def steps(gw: Gateway) -> dict[str, Callable[[], Any]]:
    cfg = gw.config
    ccfg = cfg.classification
    body = orjson.loads(RAW)
    profile = classify(body, "chat", ccfg, gw.counter)
    pools = cfg.pools_by_size()
    coordinator = Coordinator(gw)
    choice, _, _ = run_sync(coordinator.choose_pool(profile, body, "chat", None, len(RAW)))
    runtime = gw.pools["interactive"]
    replica = next(iter(runtime.replicas.values()))
    now = gw.clock()
    snaps = runtime.snapshots(now, gw.shared)
    texts = [m["content"] for m in body["messages"]]
    # Texts never seen before (more than the short-piece cache holds, cycled): what a new user message costs
    words = BODY["messages"][0]["content"].split()
    unseen = itertools.cycle([" ".join([*words[:-1], f"w{i}"]) for i in range(UNSEEN)])
    unseen_bodies = itertools.cycle([{**body, "messages": [{"role": "user", "content": next(unseen)}]}
                                     for _ in range(UNSEEN)])
    traffic = gw.traffic
    long_chat = {**body, "messages": [{"role": "user", "content": _words(28_000)}]}
    huge_prompt = {**body, "messages": [{"role": "user", "content": _words(4_000_000)}]}

    request = _request()
    traffic.authenticate(request)  # as on the request path: the headers are parsed once (telemetry reads them first)
    record = RequestRecord(api="chat", stream=False, t_arrival=0.0)

    def admit() -> Any:
        admitted = run_sync(traffic.admit(request, record, ANONYMOUS, profile, choice))
        traffic.finished(record)
        return admitted

    sessions = gw.sessions
    assert sessions is not None
    named = [*HEADERS, (b"x-session-id", b"bench-session-1")]
    unnamed = list(HEADERS)
    history = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Sure, here it is."},
                                    {"role": "user", "content": "And now in French, please."}]}

    def session_turn(headers: list[tuple[bytes, bytes]], turn_body: dict[str, Any]) -> None:
        turn_record = RequestRecord(api="chat", stream=False, t_arrival=0.0)
        sessions.begin(turn_record, headers, turn_body, "chat", 0.0)
        turn_record.status = 200
        sessions.end(turn_record, None)

    return {
        "check_header_size": lambda: check_header_size(HEADERS, cfg.limits.max_header_bytes),
        "KeyStore.authenticate": lambda: traffic.keys.authenticate(request.headers),
        "TrafficControl.authenticate": lambda: traffic.authenticate(request),
        "check_input_limits": lambda: check_input_limits(body, "chat", cfg.limits),
        "TokenCounter.measure_pieces": lambda: gw.counter.measure_pieces(texts),
        "classify (incl. tokens)": lambda: classify(body, "chat", ccfg, gw.counter),
        "TokenCounter.measure_pieces, unseen text": lambda: gw.counter.measure_pieces((next(unseen),)),
        "classify, unseen text": lambda: classify(next(unseen_bodies), "chat", ccfg, gw.counter),
        "choose_pool (pure)": lambda: choose_pool(profile, pools, ccfg, saturated=frozenset()),
        "Coordinator.choose_pool": lambda: run_sync(coordinator.choose_pool(profile, body, "chat", None, len(RAW))),
        "Replica.snapshot": lambda: replica.snapshot(now),
        "PoolRuntime.snapshots (shared)": lambda: runtime.snapshots(now, gw.shared),
        "PoolRuntime.available": lambda: runtime.available(now),
        "policies pool_saturated": lambda: pool_saturated(snaps, cfg.traffic.saturation),
        "Gateway.pool_saturated": lambda: gw.pool_saturated("interactive"),
        "restrict_to_key": lambda: restrict_to_key(choice, None, False),
        "resolve_class": lambda: resolve_class(cfg.traffic, pools, "interactive", None, None),
        "request_priority": lambda: request_priority(cfg.traffic, "interactive", "adaptive"),
        "TrafficControl.admit+finished": admit,
        "sessions begin+end, x-session-id": lambda: session_turn(named, body),
        "sessions begin+end, inferred (history)": lambda: session_turn(unnamed, history),
        "sessions begin+end, one-shot (names and continues nothing)": lambda: session_turn(unnamed, body),
        # prefix hashing beyond the short request: an 8K-token chat (~33 KB) and the extended pool's 1M-token prompt
        "prefix_blocks, 8K-token chat": lambda: prefix_blocks(long_chat, "chat", cfg.model),
        "prefix_blocks, 1M-token prompt": lambda: prefix_blocks(huge_prompt, "chat", cfg.model),
    }


def bench(fn: Callable[[], Any], repeats: int, budget_s: float) -> float:
    """Best µs per call over `repeats` runs, each about `budget_s` long."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    number = max(1, int(number * budget_s / 0.2))
    return min(timer.repeat(repeat=repeats, number=number)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.hotpath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget-ms", type=float, default=40.0)
    parser.add_argument("--quick", action="store_true", help="3 repeats of 10 ms each")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-hotpath)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.budget_ms = 3, 10.0
    gw = Gateway(config())
    rows = [(name, bench(fn, args.repeats, args.budget_ms / 1000)) for name, fn in steps(gw).items()]
    width = max(len(name) for name, _ in rows)
    print(f"{'step':<{width}}  µs/call (best of {args.repeats})")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.2f}")
    results = Results("hotpath", vars(args), reference="none: each step's own CPU time, best of the repeats")
    for name, us in rows:
        results.add(name, us, "µs")
    folder = args.out or run_dir("hotpath")
    results.write(folder)
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
