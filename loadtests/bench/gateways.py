"""Several gateways sharing Redis in front of one fleet: prefix affinity across gateways, Redis commands per request,
and a gateway killed mid-run.

    python -m loadtests.bench.gateways [--quick] [--gateways 8] [--replicas 64] [--sessions 320] [--turns 6]
                                       [--concurrency 128] [--answer-ms 300] [--out DIR]

A fleet of `--replicas` vLLM-like workers in one process (loadtests/bench/scale.py's; each answer names the worker
that served it, `--answer-ms` after the request, so the requests in flight are load the routers see), a private Redis (loadtests/lib/private_redis.py) and a multi-turn workload: `--sessions`
conversations of `--turns` turns, each opening with one of `sessions / 8` system prompts of 2,000 tokens (hundreds of
distinct prefixes: every conversation's growing history, and the shared system prompts), a 300-token question per
turn and the answer appended, `--concurrency` conversations at a time, each turn sent to the next gateway in turn
(round robin over the live gateways: a conversation's consecutive turns reach different gateways). Three variants
on the same workload, each on fresh gateways:

- **one gateway** (memory state): the reference;
- **shared**: `--gateways` gateways with `state: redis://…` (one database): each learns the others' dispatches and
  session pins; half-way through, gateway 0 is killed (SIGKILL) and the client drops it from its rotation (a
  request it had in flight is sent again to the next one, as a client-side balancer would);
- **independent**: `--gateways` gateways with memory state, each routing on what it saw alone.

The hit rate is the prefix-cache hit rate of replicas whose caches never evict (a token counts as a hit when the
replica that served it had served the same leading 128-token blocks before, as vLLM's prefix cache counts), computed
from which worker served each request: a measure of where routing put each prefix, not of cache size. Goals
(issue: fleet scale): the shared gateways' hit rate ≥ 0.95 × one gateway's (a published reference for the same
shape: a shared index 0.873 against 0.727 for independent routers); after the kill, every conversation whose
earlier turn went through the killed gateway keeps its replica on its next turn. Reported beside them: Redis
commands per request (INFO commandstats, the shared variant's run), the independent gateways' hit rate, and the
share of turns that stayed on their conversation's replica.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.bench.scale import Fleet, scale_config
from loadtests.lib.harness import write_results
from loadtests.lib.private_redis import PrivateRedis
from loadtests.lib.replicas import GatewayProc, raise_fd_limit
from loadtests.lib.results import Results
from loadtests.lib.textgen import text, text_uncached

MODEL = "MiniMaxAI/MiniMax-M3"
BLOCK_BYTES = 128 * 4  # one 128-token block of the fleet's 4-bytes-per-token text
SYSTEM_TOKENS = 2000
QUESTION_TOKENS = 300
ANSWER = "hello " * 16  # the fleet's answer
GOAL_SHARED = 0.95


@dataclass
class Turn:
    session: int
    turn: int
    gateway: int = -1  # the index of the gateway that served it
    worker: str = ""
    prompt_blocks: int = 0
    hit_blocks: int = 0
    retried: bool = False
    ok: bool = False
    after_kill: bool = False


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)
    redis_calls: int | None = None
    killed: int | None = None  # the killed gateway's index
    seconds: float = 0.0

    def hit_rate(self) -> float:
        total = sum(t.prompt_blocks for t in self.turns if t.ok)
        return sum(t.hit_blocks for t in self.turns if t.ok) / total if total else 0.0

    def stayed(self) -> float:
        """The share of later turns served by the worker that served the conversation's previous turn."""
        last: dict[int, str] = {}
        same = later = 0
        for t in sorted((t for t in self.turns if t.ok), key=lambda t: (t.session, t.turn)):
            if t.session in last:
                later += 1
                same += last[t.session] == t.worker
            last[t.session] = t.worker
        return same / later if later else 0.0

    def kept_after_kill(self) -> tuple[int, int]:
        """Conversations whose last turn before the kill went through the killed gateway: how many kept their
        worker on their first turn after it, of how many had one."""
        if self.killed is None:
            return 0, 0
        by_session: dict[int, list[Turn]] = {}
        for t in self.turns:
            if t.ok:
                by_session.setdefault(t.session, []).append(t)
        kept = total = 0
        for turns in by_session.values():
            turns.sort(key=lambda t: t.turn)
            for before, after in zip(turns, turns[1:]):
                if not before.after_kill and after.after_kill:
                    if before.gateway == self.killed:
                        total += 1
                        kept += before.worker == after.worker
                    break
        return kept, total


def conversation(session: int, turns: int, systems: int) -> list[list[dict[str, str]]]:
    """The messages of each turn: the group's system prompt, then the history, growing turn by turn."""
    system = {"role": "system", "content": text(f"system-{session % systems}", SYSTEM_TOKENS)}
    history: list[dict[str, str]] = [system]
    out = []
    for k in range(turns):
        history = [*history, {"role": "user", "content": text_uncached(f"q-{session}-{k}", QUESTION_TOKENS)}]
        out.append(history)
        history = [*history, {"role": "assistant", "content": ANSWER}]
    return out


def block_hashes(messages: list[dict[str, str]]) -> list[bytes]:
    """Chained hashes of the prompt's full 128-token blocks (the fleet's text is 4 bytes a token)."""
    flat = "".join(f"<{m['role']}>{m['content']}" for m in messages).encode()
    out, parent = [], b""
    for i in range(len(flat) // BLOCK_BYTES):
        parent = hashlib.blake2b(parent + flat[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES], digest_size=12).digest()
        out.append(parent)
    return out


class Cache:
    """Per worker, every block it has served (no eviction): what a request would hit there."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[bytes]] = {}

    def serve(self, worker: str, hashes: list[bytes]) -> int:
        held = self.blocks.setdefault(worker, set())
        hits = 0
        for h in hashes:
            if h not in held:
                break
            hits += 1
        held.update(hashes)
        return hits


async def run_variant(name: str, urls: list[str], plans: list[list[list[dict[str, str]]]], concurrency: int,
                      procs: list[GatewayProc], kill_at: float | None, think_s: float) -> Run:
    """Every conversation, `concurrency` at a time, each turn to the next live gateway; with `kill_at`, gateway 0
    is killed once that share of all turns has been answered."""
    run = Run(name)
    cache = Cache()
    live = list(range(len(urls)))
    counter = 0
    total = sum(len(p) for p in plans)
    answered = 0
    killed = asyncio.Event()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in range(len(plans)):
        queue.put_nowait(s)

    def next_gateway() -> int:
        nonlocal counter
        counter += 1
        return live[counter % len(live)]

    async def one_turn(http: aiohttp.ClientSession, turn: Turn, messages: list[dict[str, str]]) -> None:
        nonlocal answered
        body = {"model": MODEL, "messages": messages, "max_tokens": 16}
        hashes = block_hashes(messages)
        for attempt in range(3):
            gw = next_gateway()
            try:
                async with http.post(urls[gw] + "/v1/chat/completions", json=body) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status != 200:
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError):
                turn.retried = True  # its gateway died under it: the next one takes it
                continue
            turn.gateway, turn.worker, turn.ok = gw, str(answer.get("id", "")), True
            turn.after_kill = killed.is_set()
            turn.prompt_blocks = len(hashes)
            turn.hit_blocks = cache.serve(turn.worker, hashes)
            break
        answered += 1
        if kill_at is not None and not killed.is_set() and answered >= kill_at * total:
            run.killed = 0
            os.kill(procs[0].pid, signal.SIGKILL)
            live.remove(0)
            killed.set()

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            s = queue.get_nowait()
            for k, messages in enumerate(plans[s]):
                turn = Turn(s, k)
                run.turns.append(turn)
                await one_turn(http, turn, messages)
                await asyncio.sleep(think_s)

    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    run.seconds = time.perf_counter() - t0
    return run


def redis_calls(redis: PrivateRedis) -> int:
    stats = redis.client().info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def variant(name: str, fleet: Fleet, count: int, redis_url: str | None, plans: list[Any], args: argparse.Namespace,
            redis: PrivateRedis, kill: bool) -> Run:
    config = scale_config(fleet.urls)
    if redis_url:
        config["state"] = redis_url
    procs = [GatewayProc(config) for _ in range(count)]
    try:
        time.sleep(3.0)  # every replica probed by every gateway
        before = redis_calls(redis)
        run = asyncio.run(run_variant(name, [p.url for p in procs], plans, args.concurrency, procs,
                                      0.5 if kill else None, args.think_ms / 1000))
        if redis_url:
            run.redis_calls = redis_calls(redis) - before
        return run
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.stop()


def report(runs: dict[str, Run], args: argparse.Namespace) -> tuple[str, Results]:
    one, shared, independent = runs["one gateway"], runs["shared"], runs["independent"]
    out = Results("gateways", vars(args), reference="one gateway, the same conversations")
    ratio = shared.hit_rate() / one.hit_rate() if one.hit_rate() else None
    kept, had = shared.kept_after_kill()
    requests = sum(1 for t in shared.turns if t.ok)
    lines = [f"## {args.gateways} gateways sharing Redis in front of {args.replicas} replicas", "",
             f"{args.sessions} conversations × {args.turns} turns ({args.sessions // 8} system prompts of "
             f"{SYSTEM_TOKENS:,} tokens), {args.concurrency} at a time, each turn to the next gateway.", "",
             "| variant | hit rate (never-evicting caches) | turns on their conversation's last replica | answered | "
             "retried | seconds |", "|---|---|---|---|---|---|"]
    for run in runs.values():
        ok = sum(1 for t in run.turns if t.ok)
        lines.append(f"| {run.name} | {run.hit_rate():.3f} | {run.stayed():.3f} | {ok} / {len(run.turns)} | "
                     f"{sum(t.retried for t in run.turns)} | {run.seconds:.0f} |")
    per_request = shared.redis_calls / requests if shared.redis_calls is not None and requests else None
    lines += ["", f"- shared ÷ one gateway: **{ratio:.3f}** (goal ≥ {GOAL_SHARED})" if ratio is not None else "",
              f"- independent ÷ one gateway: {independent.hit_rate() / one.hit_rate():.3f}" if one.hit_rate() else "",
              f"- Redis commands per request (shared): {per_request:.2f}" if per_request is not None else "",
              f"- gateway 0 killed half-way: {kept} / {had} conversations whose last turn went through it kept their "
              "replica on their next turn"]
    out.add("shared gateways' hit rate ÷ one gateway's", ratio, "×", at_least=GOAL_SHARED)
    out.add("independent gateways' hit rate ÷ one gateway's",
            independent.hit_rate() / one.hit_rate() if one.hit_rate() else None, "×")
    out.add("one gateway's hit rate", one.hit_rate(), "")
    out.add("Redis commands per request (shared)", per_request, "")
    out.add("conversations of the killed gateway that kept their replica", kept / had if had else None, "",
            at_least=1.0)
    return "\n".join(line for line in lines if line is not None), out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.gateways", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="160 conversations of 4 turns")
    parser.add_argument("--gateways", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=320)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--think-ms", type=float, default=50.0, help="pause between a conversation's turns")
    parser.add_argument("--answer-ms", type=float, default=300.0,
                        help="each answer this late: requests in flight that load-aware choice sees")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns = 160, 4
    raise_fd_limit()
    plans = [conversation(s, args.turns, max(1, args.sessions // 8)) for s in range(args.sessions)]
    t0 = time.monotonic()
    redis = PrivateRedis()
    redis.start()
    fleet = Fleet(args.replicas, args.answer_ms)
    runs: dict[str, Run] = {}
    try:
        for db, (name, count, shared, kill) in enumerate((("one gateway", 1, False, False),
                                                         ("shared", args.gateways, True, True),
                                                         ("independent", args.gateways, False, False)), start=1):
            url = f"redis://127.0.0.1:{redis.port}/{db}" if shared else None
            runs[name] = variant(name, fleet, count, url, plans, args, redis, kill)
            r = runs[name]
            print(f"{name}: hit rate {r.hit_rate():.3f}, stayed {r.stayed():.3f}, {r.seconds:.0f} s", flush=True)
    finally:
        fleet.stop()
        redis.stop()
    md, results = report(runs, args)
    md += f"\n\nRan {time.monotonic() - t0:.0f} s on {os.cpu_count()} CPUs."
    print(md)
    folder = write_results(args.out, "gateways", {"args": {k: str(v) for k, v in vars(args).items()},
                                                  "runs": {n: {"hit_rate": r.hit_rate(), "stayed": r.stayed(),
                                                               "redis_calls": r.redis_calls, "seconds": r.seconds,
                                                               "kept_after_kill": r.kept_after_kill()}
                                                           for n, r in runs.items()}}, md)
    results.write(folder)
    print(f"results: {folder}")
    return 0 if results.passed is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
