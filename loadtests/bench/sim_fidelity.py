"""How faithfully does the simulator's prefix cache follow real vLLM's? Replay one trace against both and compare.

The trace is what a chat product sends: a few conversations whose histories grow turn by turn, all opening with the
same system prompt, interleaved. Assistant turns are fixed text (not what either server generated), so both
servers receive byte-identical requests. Requests go one at a time: with concurrency the real engine's batching
decides which of two simultaneous requests sees the other's blocks (`--concurrent` measures that case too).

Printed: each server's `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the replay (deltas),
their relative difference (target: within 5%), and how many requests got a different `cached_tokens`; the same as
`results.json` (loadtests/lib/results.py) in `--out`, by default loadtests/results/<time>-sim-fidelity/.

    python -m loadtests.bench.sim_fidelity                      # starts one real vLLM server and one simulator
    python -m loadtests.bench.sim_fidelity --vllm-url URL       # reuse a running server (e.g. from `make vllm-up`)
    python -m loadtests.bench.sim_fidelity --quick [--out DIR]  # 2 conversations x 3 turns
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results

SERVED_MODEL = "MiniMaxAI/MiniMax-M3"
TARGET_RELATIVE_DIFFERENCE = 0.05
_WORDS = (
    "route pool replica cache prefix block token stream context request model answer question tool weather city "
    "budget latency queue thinking reason result value error message summary detail plan step check data"
).split()


@dataclass(frozen=True)
class TraceConfig:
    conversations: int = 4
    turns: int = 6
    system_words: int = 250
    user_words: int = 60
    assistant_words: int = 40
    max_tokens: int = 4
    seed: int = 7


def build_trace(config: TraceConfig, nonce: str = "") -> list[list[dict[str, str]]]:
    """The message lists to send, in order: turn 1 of every conversation, then turn 2 of every one, and so on.

    `nonce` opens the system prompt so that a rerun against a reused server starts from a cold cache again.
    """
    rng = random.Random(config.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    system = {
        "role": "system",
        "content": f"[{nonce}] You are the m3gate test assistant. " + words(config.system_words),
    }
    histories: list[list[dict[str, str]]] = [[system] for _ in range(config.conversations)]
    requests = []
    for _turn in range(config.turns):
        for history in histories:
            history.append({"role": "user", "content": words(config.user_words)})
            requests.append(list(history))
            history.append({"role": "assistant", "content": words(config.assistant_words)})
    return requests


@dataclass
class ReplayResult:
    name: str
    hits: float
    queries: float
    cached_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


async def _counter(client: httpx.AsyncClient, sample: str) -> float:
    text = (await client.get("/metrics")).raise_for_status().text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == sample)


async def _counters_settled(client: httpx.AsyncClient, requests_before: float, expected: int) -> None:
    """Wait until the server has counted every request (its metrics trail the responses slightly)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        done = await _counter(client, "vllm:request_success_total")
        if done - requests_before >= expected:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the server's request_success_total did not catch up within 10 s")


async def replay(
    name: str, url: str, trace: list[list[dict[str, str]]], max_tokens: int, *, wave: int = 1
) -> ReplayResult:
    """Send the trace in order, `wave` requests at a time (wave = conversations: each turn's requests together)."""
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        hits0 = await _counter(client, "vllm:prefix_cache_hits_total")
        queries0 = await _counter(client, "vllm:prefix_cache_queries_total")
        requests0 = await _counter(client, "vllm:request_success_total")
        result = ReplayResult(name, 0.0, 0.0)

        async def send(messages: list[dict[str, str]]) -> dict[str, Any]:
            body = {
                "model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
                "chat_template_kwargs": {"thinking_mode": "disabled"},
            }  # fmt: skip
            response = await client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{name}: {response.status_code} {response.text[:500]}")
            return dict(response.json()["usage"])

        began = time.monotonic()
        for start in range(0, len(trace), wave):
            for usage in await asyncio.gather(*(send(m) for m in trace[start : start + wave])):
                result.prompt_tokens.append(int(usage["prompt_tokens"]))
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens.append(int(details.get("cached_tokens") or 0))
        result.seconds = time.monotonic() - began
        await _counters_settled(client, requests0, len(trace))
        result.hits = await _counter(client, "vllm:prefix_cache_hits_total") - hits0
        result.queries = await _counter(client, "vllm:prefix_cache_queries_total") - queries0
    return result


def relative_difference(sim: float, real: float) -> float:
    return abs(sim - real) / real if real else (0.0 if sim == real else float("inf"))


def report(real: ReplayResult, sim: ReplayResult) -> dict[str, Any]:
    mismatched = [i for i, (a, b) in enumerate(zip(real.cached_tokens, sim.cached_tokens, strict=True)) if a != b]
    prompt_mismatch = [i for i, (a, b) in enumerate(zip(real.prompt_tokens, sim.prompt_tokens, strict=True)) if a != b]
    return {
        "requests": len(real.cached_tokens),
        "vllm": {"hits": real.hits, "queries": real.queries, "hit_rate": round(real.hit_rate, 5),
                 "replay_s": round(real.seconds, 2)},
        "sim": {"hits": sim.hits, "queries": sim.queries, "hit_rate": round(sim.hit_rate, 5),
                "replay_s": round(sim.seconds, 2)},
        "relative_difference": round(relative_difference(sim.hit_rate, real.hit_rate), 5),
        "target": TARGET_RELATIVE_DIFFERENCE,
        "requests_with_different_cached_tokens": len(mismatched),
        "requests_with_different_prompt_tokens": len(prompt_mismatch),
        "first_differences": [
            {"request": i, "prompt_tokens": [real.prompt_tokens[i], sim.prompt_tokens[i]],
             "cached_tokens": [real.cached_tokens[i], sim.cached_tokens[i]]}
            for i in sorted(set(mismatched) | set(prompt_mismatch))[:5]
        ],
    }  # fmt: skip


def results_of(summary: dict[str, Any], args: argparse.Namespace) -> Results:
    """The simulator's hit rate beside real vLLM's, their relative difference against the 5% target, and the requests
    whose counts differ, in the one results format."""
    results = Results("sim_fidelity", vars(args), reference="real vLLM (the tiny model) on the same trace")
    results.add("simulator prefix-cache hit rate", 100 * summary["sim"]["hit_rate"], "%", reference="vLLM",
                reference_value=100 * summary["vllm"]["hit_rate"])
    results.add("relative difference of the hit rates", 100 * summary["relative_difference"], "%",
                at_most=100 * TARGET_RELATIVE_DIFFERENCE)
    results.add("requests with a different cached_tokens", summary["requests_with_different_cached_tokens"],
                "requests", reference="requests sent", reference_value=summary["requests"])
    results.add("requests with a different prompt_tokens", summary["requests_with_different_prompt_tokens"],
                "requests", reference="requests sent", reference_value=summary["requests"])
    return results


def _print(summary: dict[str, Any], config: TraceConfig, real: ReplayResult, sim: ReplayResult) -> None:
    print(f"{summary['requests']} requests: {config.conversations} conversations x {config.turns} turns, shared "
          "system prompt")
    print(f"{'':8}{'hits':>10}{'queries':>10}{'hit rate':>10}")
    for name, result in (("vllm", real), ("sim", sim)):
        print(f"{name:8}{result.hits:>10.0f}{result.queries:>10.0f}{result.hit_rate:>10.4f}")
    difference = summary["relative_difference"]
    verdict = "within" if difference <= TARGET_RELATIVE_DIFFERENCE else "OUTSIDE"
    print(f"relative difference {difference:.2%} ({verdict} the {TARGET_RELATIVE_DIFFERENCE:.0%} target)")
    print(f"requests with a different cached_tokens: {summary['requests_with_different_cached_tokens']}, "
          f"with a different prompt_tokens: {summary['requests_with_different_prompt_tokens']}")
    if summary["first_differences"]:
        print("first differences (vllm, sim):", json.dumps(summary["first_differences"]))


@contextlib.contextmanager
def _servers(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """The real server's and the simulator's URLs: given ones are reused, missing ones started (and stopped)."""
    with contextlib.ExitStack() as stack:
        vllm_url = args.vllm_url
        if not vllm_url:
            from pools.vllm_local.launcher import running_servers

            print(f"starting a real vLLM server (--max-model-len {args.max_model_len}) ...", file=sys.stderr)
            [server] = stack.enter_context(running_servers([args.max_model_len]))
            vllm_url = server.url
        sim_url = args.sim_url
        if not sim_url:
            from pools.sim.launcher import start_sim
            from pools.vllm_local.tiny_model import ensure_tiny_tokenizer

            sim = start_sim(
                args.max_model_len,
                extra_args=[
                    "--tokenizer", str(ensure_tiny_tokenizer()), "--block-size", "128",
                    "--kv-blocks", str(args.sim_kv_blocks), "--instant",
                ],
            )  # fmt: skip
            stack.callback(sim.stop)
            sim_url = sim.url
        yield vllm_url, sim_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", help="a running real server serving the tiny model (default: start one)")
    parser.add_argument(
        "--sim-url", help="a running simulator started with --tokenizer <tiny dir> (default: start one)"
    )
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--sim-kv-blocks", type=int, default=16384, help="as the real server's 1 GiB cache holds")
    parser.add_argument("--conversations", type=int, default=TraceConfig.conversations)
    parser.add_argument("--turns", type=int, default=TraceConfig.turns)
    parser.add_argument("--seed", type=int, default=TraceConfig.seed)
    parser.add_argument(
        "--concurrent", action="store_true", help="send each turn of all conversations at once (batching effects)"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    parser.add_argument("--quick", action="store_true", help="2 conversations x 3 turns")
    parser.add_argument("--out", type=Path, help="results folder (default loadtests/results/<time>-sim-fidelity)")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 2, 3
    config = TraceConfig(conversations=args.conversations, turns=args.turns, seed=args.seed)
    trace = build_trace(config, nonce=uuid.uuid4().hex)

    with _servers(args) as (vllm_url, sim_url):
        wave = config.conversations if args.concurrent else 1
        real = asyncio.run(replay("vllm", vllm_url, trace, config.max_tokens, wave=wave))
        sim = asyncio.run(replay("sim", sim_url, trace, config.max_tokens, wave=wave))
    summary = report(real, sim)
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary, config, real, sim)
    folder = args.out or run_dir("sim-fidelity")
    results = results_of(summary, args)
    results.write(folder)
    if not args.json:
        print(f"results: {folder}")
    return 0 if results.passed else 1

if __name__ == "__main__":
    sys.exit(main())
