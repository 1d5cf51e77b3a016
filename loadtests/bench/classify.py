"""How long classification and pool choice take on the gateway's hot path, from a short chat to a 1M-token one.

`python -m loadtests.bench.classify` builds agent-like chat requests (a system prompt, tool schemas, many turns with
tool calls and results, a few huge pasted files) of about 1K, 32K, 128K and 1M tokens from varied real text — Python
source, English docstrings, JSON records, Chinese and Japanese prose — then times `classify` + `choose_pool` with
the current token counter and compares with what a full exact count of the same text would cost; `--against DIR`
times another checkout's counter (its policies/tokens.py, loadtests/lib/against.py) interleaved on the same chats.
The target is ≤ 3 ms p50 cold at every size up to 1M tokens, with the pool chosen from the estimate the one chosen
from the exact count (or a /tokenize asked first).
`--long` measures the gateway's CPU per cold long chat end to end instead (loadtests/bench/classify_http.py).

The text builders are also used by the unit tests to make prompts of an intended size.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from loadtests.bench.classify_http import coordinator_choice
from loadtests.lib.against import checkout, token_counter
from loadtests.lib.agent_corpus import TextCorpus, agent_chat
from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.pool_choice import PoolChoice, choose_pool
from policies.tokens import TokenCounter
from policies.config import ClassificationConfig, PoolConfig

def product_pools() -> list[PoolConfig]:
    return [
        PoolConfig(name="interactive", max_model_len=32_768, modalities=["text", "image"]),
        PoolConfig(name="repository", max_model_len=131_072, modalities=["text", "image"]),
        PoolConfig(name="extended", max_model_len=1_048_576, modalities=["text", "image", "video"]),
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _classify_and_choose(body: dict[str, Any], cfg: ClassificationConfig, counter: TokenCounter,
                         pools: list[PoolConfig]) -> tuple[float, RequestProfile, PoolChoice | None, bool]:
    """`coordinator_choice` and the CPU seconds of this thread it took (not wall time: on a shared machine that
    mostly measures the other processes)."""
    start = time.thread_time()
    profile, choice, refined = coordinator_choice(body, cfg, counter, pools)
    return time.thread_time() - start, profile, choice, refined


def run(sizes: list[int], requests: int, repeats: int, seed: int, cfg: ClassificationConfig | None = None,
        against: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per size and counter ("new": policies.tokens; each of `against`, a label → another checkout's
    TokenCounter class, on the same chats, interleaved): cold and warm-cache timings, the full exact count's cost,
    the estimate's error and stated bound, and
    whether the pool chosen from the estimate is the one chosen from the exact count (or a /tokenize is asked)."""
    cfg = cfg or ClassificationConfig()
    exact_cfg = cfg.model_copy(update={"full_count_below_chars": 10**12})  # the same render, fully tokenized
    pools = product_pools()
    corpus = TextCorpus()
    rng = random.Random(seed)
    counters: dict[str, Callable[[], Any]] = {"new": lambda: TokenCounter(cfg)}
    for label, cls in (against or {}).items():
        counters[label] = lambda cls=cls: cls(cfg)
    rows = []
    for size in sizes:
        bodies = [agent_chat(corpus, size, rng) for _ in range(requests)]
        _as_the_gateway_collects()
        cold: dict[str, list[float]] = {name: [] for name in counters}
        warm: dict[str, list[float]] = {name: [] for name in counters}
        raws = [orjson.dumps(body) for body in bodies]
        for repeat in range(repeats):
            for k, raw in enumerate(raws):
                order = list(counters) if (repeat + k) % 2 == 0 else list(reversed(counters))
                for name in order:  # interleaved, each first in turn: both see the same machine noise
                    body = orjson.loads(raw)  # freshly parsed, as the gateway classifies it (not timed)
                    counter = counters[name]()  # an empty cache: nothing counted before
                    cold[name].append(_classify_and_choose(body, cfg, counter, pools)[0])
                    warm[name].append(_classify_and_choose(body, cfg, counter, pools)[0])  # a next turn
        exact_times, exact_profiles, exact_choices = [], [], []
        for body in bodies:
            seconds, profile, _, _ = _classify_and_choose(body, exact_cfg, TokenCounter(exact_cfg), pools)
            exact_times.append(seconds)
            exact_profiles.append(profile)
            exact_choices.append(_choice(profile, pools, cfg))
        for name, make in counters.items():
            errors, bounds, same, asks, sampled, refined = [], [], 0, 0, False, 0
            for body, exact, exact_choice in zip(bodies, exact_profiles, exact_choices):
                estimated, choice, full = coordinator_choice(body, cfg, make(), pools)
                refined += full
                errors.append(estimated.prompt_tokens / exact.prompt_tokens - 1)
                bounds.append(estimated.estimate_error)
                sampled = sampled or not estimated.estimate_exact
                pool, asked = ("rejected", False) if choice is None else (choice.pool.name, choice.needs_exact_count)
                asks += asked
                same += pool == exact_choice[0] or asked  # a /tokenize then decides as the exact count does
            rows.append({
                "target": size,
                "counter": name,
                "tokens": int(statistics.median(p.prompt_tokens for p in exact_profiles)),
                "messages": len(bodies[0]["messages"]),
                "p50_ms": _percentile(cold[name], 0.5) * 1e3,
                "p99_ms": _percentile(cold[name], 0.99) * 1e3,
                "warm_p50_ms": _percentile(warm[name], 0.5) * 1e3,
                "exact_ms": statistics.median(exact_times) * 1e3,
                "worst_error": max(errors, key=abs),
                "max_bound": max(bounds),
                "within_bound": all(abs(e) <= b for e, b in zip(errors, bounds)),
                "sampled": sampled,
                "pool": exact_choices[0][0],
                "same_pool": f"{same}/{len(bodies)}",
                "tokenize": f"{asks}/{len(bodies)}",
                "full_sample": f"{refined}/{len(bodies)}",  # the coarse estimate straddled a limit: sampled again
                "exact_tokenize": f"{sum(asked for _, asked in exact_choices)}/{len(bodies)}",
            })
    return rows


def _as_the_gateway_collects() -> None:
    """The garbage collector as `m3gate serve` sets it (gateway/server.py): what exists now (the chats, the corpus)
    frozen out of its sight, young passes every 7,000 allocations. Else a pass that rescans the chats' tens of
    thousands of objects lands in some timings and not others."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 20, 20)


def _choice(profile: RequestProfile, pools: list[PoolConfig], cfg: ClassificationConfig) -> tuple[str, bool]:
    """The pool chosen (or "rejected") and whether the gateway would ask a replica's /tokenize first."""
    try:
        choice = choose_pool(profile, pools, cfg)
    except RequestRejected:
        return "rejected", False
    return choice.pool.name, choice.needs_exact_count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,32000,128000,1000000", help="target prompt sizes in tokens")
    parser.add_argument("--requests", type=int, default=5, help="distinct requests per size")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per request")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--full-count-below-chars", type=int, default=None,
                        help="set classification.full_count_below_chars (where sampling starts) for every counter")
    parser.add_argument("--quick", action="store_true", help="1K, 32K and 128K tokens, 2 requests, 5 repeats")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-classify)")
    parser.add_argument("--against", action="append", default=[], metavar="DIR",
                        help="another checkout (e.g. a git worktree) whose token counter is timed beside this one's")
    parser.add_argument("--long", action="store_true",
                        help="end to end instead: a gateway process before --instant simulators, its CPU per cold "
                             "long chat over HTTP (loadtests.bench.classify_http)")
    argv = sys.argv[1:] if argv is None else argv
    if "--long" in argv:
        from loadtests.bench.classify_http import main as http_main

        return http_main([a for a in argv if a != "--long"])
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.requests, args.repeats = "1000,32000,128000", 2, 5
    cfg = ClassificationConfig()
    if args.full_count_below_chars:
        cfg = cfg.model_copy(update={"full_count_below_chars": args.full_count_below_chars})
    against = {checkout(p).name: token_counter(checkout(p)) for p in args.against}
    rows = run([int(s) for s in args.sizes.split(",")], args.requests, args.repeats, args.seed, cfg, against)
    print("classify + choose_pool on agent-like chats, CPU time of the thread (cold: empty count cache; warm: the")
    print("same history again);")
    print("new = policies.tokens; any other counter: that --against checkout's, interleaved with it;")
    print("exact = the same classification with every text fully tokenized; error = estimate vs exact, worst request;")
    print("bound = the largest error bound stated (pool choice combines it with its band); pool = chosen from the exact")
    print("count; same = chose it too or asked /tokenize; /tok = asked a replica's /tokenize (the exact count's in")
    print("brackets); full = the coarse first estimate straddled a pool's limit and the full sample was taken")
    print(f"{'target':>9} {'tokens':>9} {'msgs':>5} {'counter':>9} {'p50 ms':>8} {'p99 ms':>8} {'warm p50':>9} "
          f"{'exact ms':>9} {'error':>7} {'bound':>6} {'sampled':>7}  {'pool':<12} {'same':>5} {'/tok':>9} {'full':>5}")
    for r in rows:
        print(f"{r['target']:>9,} {r['tokens']:>9,} {r['messages']:>5} {r['counter']:>9} {r['p50_ms']:>8.3f} "
              f"{r['p99_ms']:>8.3f} {r['warm_p50_ms']:>9.3f} {r['exact_ms']:>9.2f} {r['worst_error']:>+7.2%} "
              f"{r['max_bound']:>6.1%} {str(r['sampled']):>7}  {r['pool']:<12} {r['same_pool']:>5} "
              f"{r['tokenize']:>4} ({r['exact_tokenize']}) {r['full_sample']:>5}")
    print(f"results: {write_results(rows, args)}")
    return 0


def write_results(rows: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    """results.json: per size, this checkout's cold p50 against the ≤ 3 ms goal beside the exact count's cost, and
    whether the pool chosen matches the exact count's; another counter's p50 beside it."""
    results = Results("classify", vars(args), reference="a full exact count of the same chats")
    for r in rows:
        size = f"{r['tokens']:,} tokens"
        if r["counter"] == "new":
            results.add(f"classify + choose_pool p50 cold, {size}", r["p50_ms"], "ms", at_most=3.0,
                        reference="exact count", reference_value=r["exact_ms"])
            same, total = map(int, r["same_pool"].split("/"))
            results.add(f"pool as from the exact count, {size}", 100 * same / total, "%", at_least=100)
        else:
            results.add(f"{r['counter']}'s counter p50 cold, {size}", r["p50_ms"], "ms")
    folder = args.out or run_dir("classify")
    results.write(folder)
    return folder


if __name__ == "__main__":
    raise SystemExit(main())
