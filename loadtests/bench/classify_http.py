"""Gateway CPU per cold long chat, end to end over HTTP: body read, parse, classify, pool choice, prefix hashing, relay.

    python -m loadtests.bench.classify --long [--sizes 32000,900000] [--requests 6] [--rounds 2] [--against DIR]
                                              [--out DIR] [--quick]

Three pools (32K / 128K / 1M context) of one `--instant` simulator each, and two gateway processes in front of them:
this checkout's ("new") and, with `--against DIR`, another checkout's (e.g. a `git worktree` of the commit before),
started the same way from its own directory. Each request is an agent-like chat (loadtests.bench.classify's
`agent_chat`: a system prompt, tools, many turns, huge pasted files) that neither gateway has seen (cold count caches
and prefix index), streamed, with max_tokens 16 so that the answer is a few SSE events; the same chats go to every
gateway, one request at a time, alternating which goes first. A gateway's CPU per request is read from
/proc/PID/task/*/schedstat (every thread, to the nanosecond: bodies over 1 MiB are classified in a worker thread)
before the request and after its answer, so what other processes do on this shared machine is not counted; its idle
CPU (health checks, /metrics scrapes: ~3 ms a second), measured for a second before each size, is subtracted for as
long as each request took. The
gateways are pinned to CPU 0, this process and the simulators to CPU 1, where the machine has two.

The chats are made to be within 3% of each size (exact count). Reported per size and gateway: the chats' exact token
count (median), gateway CPU per request p50 and max, how many chats made that gateway ask a replica's /tokenize first
(near a pool's limit: computed in-process with the same policies) and the p50 over the others. Targets: ≤ 5 ms for a
~28K-token chat, ≤ 25 ms for a ~900K-token one. results.json in `--out` (loadtests/lib/results.py).
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from loadtests.lib.against import checkout, token_counter
from loadtests.lib.agent_corpus import TextCorpus, agent_chat
from loadtests.lib.harness import run_dir
from loadtests.lib.replicas import GatewayProc, pin, thread_cpu_seconds, wait_gateway_sees
from loadtests.lib.results import Results
from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.pool_choice import PoolChoice, choose_pool
from policies.tokens import TokenCounter
from policies.config import ClassificationConfig, PoolConfig

MODEL = "MiniMaxAI/MiniMax-M3"
POOLS = (("interactive", 32_768), ("repository", 131_072), ("extended", 1_048_576))
GATEWAY_CPUS = {0}
LOAD_CPUS = {1}
SETTLE_S = 0.05  # after the answer, before reading the gateway's CPU: its end-of-request bookkeeping


def gateway_config(urls: dict[str, str]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": name, "max_model_len": size, "modalities": ["text"], "endpoints": [urls[name]]}
                  for name, size in POOLS],
        "routing": {"policy": "prefix_affinity"},
        "server": {"health_interval_s": 2.0},
        "admin": {"watch_config": False},
    }


def gateway_cpu(pid: int) -> float:
    main, others = thread_cpu_seconds(pid)
    return main + others


def idle_rate(pid: int, seconds: float = 1.0) -> float:
    """The gateway's CPU seconds per second with no request (health checks, /metrics scrapes, timers): subtracted
    from each request's CPU for as long as the request took, since a long chat keeps the simulators busy for a
    while."""
    before, start = gateway_cpu(pid), time.perf_counter()
    time.sleep(seconds)
    return (gateway_cpu(pid) - before) / (time.perf_counter() - start)


def send(conn: http.client.HTTPConnection, payload: bytes) -> tuple[int, str]:
    conn.request("POST", "/v1/chat/completions", body=payload, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status, resp.getheader("x-m3gate-pool") or ""


def coordinator_choice(body: dict[str, Any], cfg: ClassificationConfig, counter: Any, pools: list[PoolConfig]
                       ) -> tuple[RequestProfile, PoolChoice | None, bool]:
    """Classification and pool choice as gateway/coordinator.py makes them, without a replica: a coarse estimate
    first and, where its bound straddles a pool's limit, the full sample. The profile the choice rests on, the
    choice (None: rejected), and whether the full sample was taken."""
    profile = classify(body, "chat", cfg, counter)
    try:
        choice = choose_pool(profile, pools, cfg)
        if not (choice.needs_exact_count and profile.estimate_refinable):
            return profile, choice, False
        profile = classify(body, "chat", cfg, counter, precise=True)
        return profile, choose_pool(profile, pools, cfg), True
    except RequestRejected:
        return profile, None, False


def asks_tokenize(body: dict[str, Any], counter: Any, cfg: ClassificationConfig, pools: list[PoolConfig]) -> bool:
    """Whether the gateway would ask a replica's /tokenize first."""
    _, choice, _ = coordinator_choice(body, cfg, counter, pools)
    return choice is not None and choice.needs_exact_count


def chats_near(corpus: TextCorpus, tokens: int, count: int, rng: random.Random, cfg: ClassificationConfig,
               tolerance: float = 0.03) -> list[tuple[dict[str, Any], int]]:
    """`count` agent chats whose exact prompt count (classification with every text tokenized) is within
    `tolerance` of `tokens`, each with that count: agent_chat's own sizes vary by ±10%."""
    exact_cfg = cfg.model_copy(update={"full_count_below_chars": 10**12})
    chats: list[tuple[dict[str, Any], int]] = []
    target = tokens
    for _ in range(count * 20):
        body = {**agent_chat(corpus, target, rng), "max_tokens": 16}
        exact = classify(body, "chat", exact_cfg, TokenCounter(exact_cfg)).prompt_tokens
        if abs(exact / tokens - 1) <= tolerance:
            chats.append((body, exact))
            if len(chats) == count:
                return chats
        target = max(1000, int(target * (1 + 0.5 * (tokens / exact - 1))))  # steer toward the wanted size
    raise RuntimeError(f"could not make {count} chats of {tokens:,} tokens ±{tolerance:.0%}")


def run(sizes: list[int], requests: int, rounds: int, seed: int, against: list[str] = ()) -> list[dict[str, Any]]:
    """Rows per size and gateway: this checkout's ("new") and one per `against` checkout (labelled by its folder)."""
    from pools.sim.launcher import running_sims

    pin(os.getpid(), LOAD_CPUS)
    corpus = TextCorpus()
    rng = random.Random(seed)
    cfg = ClassificationConfig()
    pools = [PoolConfig(name=name, max_model_len=size, modalities=["text"]) for name, size in POOLS]
    specs = [{"max_model_len": size, "extra_args": ["--instant"]} for _, size in POOLS]
    others = {root.name: root for root in map(checkout, against)}
    makers: dict[str, Any] = {"new": lambda: TokenCounter(cfg)}
    for label, root in others.items():
        makers[label] = lambda cls=token_counter(root): cls(cfg)
    rows = []
    with running_sims(specs) as sims:
        for sim in sims:
            pin(sim.pid, LOAD_CPUS)
        config = gateway_config({name: sim.url for (name, _), sim in zip(POOLS, sims)})
        gateways = {"new": GatewayProc(config, cpus=GATEWAY_CPUS)}
        for label, root in others.items():
            gateways[label] = GatewayProc(config, cpus=GATEWAY_CPUS, cwd=root)
        try:
            for gw in gateways.values():
                wait_gateway_sees(gw.url, len(sims))
            conns = {name: http.client.HTTPConnection("127.0.0.1", gw.port, timeout=120)
                     for name, gw in gateways.items()}
            warm = {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4}
            for name in gateways:
                send(conns[name], orjson.dumps(warm))
            for size in sizes:
                chats = chats_near(corpus, size, rounds * requests, rng, cfg)
                for name, conn in conns.items():  # making the chats can outlast the gateways' keep-alive timeout
                    conn.close()
                    send(conn, orjson.dumps(warm))  # reconnects (outside the timed requests)
                idle = {name: idle_rate(gw.pid) for name, gw in gateways.items()}
                cpu: dict[str, list[tuple[float, bool]]] = {name: [] for name in gateways}
                chosen: dict[str, set[str]] = {name: set() for name in gateways}
                statuses: set[int] = set()
                for k, (body, _) in enumerate(chats):
                    payload = orjson.dumps(body)
                    asked = {name: asks_tokenize(body, make(), cfg, pools) for name, make in makers.items()}
                    order = list(gateways) if k % 2 == 0 else list(reversed(gateways))
                    for name in order:
                        pid = gateways[name].pid
                        before, start = gateway_cpu(pid), time.perf_counter()
                        status, pool = send(conns[name], payload)
                        time.sleep(SETTLE_S)
                        spent = gateway_cpu(pid) - before
                        cpu[name].append((spent - idle[name] * (time.perf_counter() - start), asked[name]))
                        statuses.add(status)
                        chosen[name].add(pool)
                for name in gateways:
                    values = [v for v, _ in cpu[name]]
                    plain = [v for v, asked in cpu[name] if not asked]
                    rows.append({
                        "target": size, "gateway": name, "tokens": int(statistics.median(t for _, t in chats)),
                        "bytes": len(payload), "requests": len(values),
                        "p50_ms": statistics.median(values) * 1e3, "max_ms": max(values) * 1e3,
                        "plain_p50_ms": statistics.median(plain) * 1e3 if plain else float("nan"),
                        "pools": ",".join(sorted(chosen[name])), "statuses": ",".join(map(str, sorted(statuses))),
                        "tokenize": f"{len(values) - len(plain)}/{len(values)}",
                    })
        finally:
            for gw in gateways.values():
                gw.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.classify --long",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="28000,900000", help="prompt sizes in tokens (chats within 3%% of each)")
    parser.add_argument("--requests", type=int, default=6, help="distinct chats per size and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--against", action="append", default=[], metavar="DIR",
                        help="another checkout (e.g. a git worktree) whose gateway runs beside this one's")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-classify_http)")
    parser.add_argument("--quick", action="store_true", help="28K tokens only, 3 chats, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.requests, args.rounds = "28000", 3, 1
    rows = run([int(s) for s in args.sizes.split(",")], args.requests, args.rounds, args.seed, args.against)
    print("gateway CPU per cold streamed chat (max_tokens 16) over HTTP, all threads (schedstat), idle CPU subtracted;")
    print("same chats to each; /tokenize = chats for which that gateway asks a replica's exact count first (near a")
    print("pool's limit), p50 w/o = over the others")
    print(f"{'target':>9} {'tokens':>9} {'body MB':>8} {'gateway':>9} {'n':>4} {'p50 ms':>8} {'max ms':>8} "
          f"{'/tokenize':>9} {'p50 w/o':>8}  pool (status)")
    for r in rows:
        print(f"{r['target']:>9,} {r['tokens']:>9,} {r['bytes'] / 1e6:>8.2f} {r['gateway']:>9} {r['requests']:>4} "
              f"{r['p50_ms']:>8.2f} {r['max_ms']:>8.2f} {r['tokenize']:>9} {r['plain_p50_ms']:>8.2f}  {r['pools']} "
              f"({r['statuses']})")
    folder = args.out or run_dir("classify_http")
    results_of(rows, args).write(folder)
    print(f"results: {folder}")
    return 0


def results_of(rows: list[dict[str, Any]], args: argparse.Namespace) -> Results:
    """This gateway's CPU per chat against the targets (≤ 5 ms near 28K tokens, ≤ 25 ms near 900K), another
    checkout's beside it, in the one results format."""
    out = Results("classify_http", vars(args), reference="the other checkouts' gateways, same chats (--against)")
    new = {r["target"]: r["p50_ms"] for r in rows if r["gateway"] == "new"}
    for r in rows:
        size = f"{r['tokens']:,} tokens"
        if r["gateway"] == "new":
            goal = 5.0 if r["target"] <= 50_000 else 25.0 if r["target"] >= 500_000 else None
            out.add(f"gateway CPU per cold chat p50, {size}", r["p50_ms"], "ms", at_most=goal)
        else:
            out.add(f"{r['gateway']}'s gateway CPU per cold chat p50, {size}", r["p50_ms"], "ms",
                    reference="this checkout", reference_value=new.get(r["target"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
