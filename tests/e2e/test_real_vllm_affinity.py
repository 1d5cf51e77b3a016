"""A multi-turn agent trace through the gateway in front of 2 REAL vLLM CPU replicas: prefix_affinity reaches the
oracle's hit rate on the replicas' own `vllm:prefix_cache_hits_total / queries_total`, where round_robin does not.

The oracle is the same trace on ONE replica: every prefix the trace shares, within and across sessions, is found in
that replica's cache (the trace fits it many times over), so no routing over two replicas can do better."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import start_gateway

pytestmark = pytest.mark.vllm

MODEL = "MiniMaxAI/MiniMax-M3"
VOCAB = "agent tool result file patch test repository function error trace build log diff commit".split()


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def agent_trace(seed: int, sessions: int = 5, turns: int = 4) -> list[list[dict[str, Any]]]:
    """Sessions sharing two system prompts, each turn growing the history; returns each request's messages.

    An odd number of sessions, so round robin over 2 replicas does not pin each session by accident."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(VOCAB) for _ in range(n))  # noqa: E731
    systems = [words(300), words(300)]
    histories = [[{"role": "system", "content": systems[s % 2]}] for s in range(sessions)]
    requests = []
    for turn in range(turns):
        for s in range(sessions):
            histories[s].append({"role": "user", "content": f"step {turn}: " + words(60)})
            requests.append(list(histories[s]))
            histories[s].append({"role": "assistant", "content": words(20)})
    return requests


def run_policy(servers: list[Any], policy: str, seed: int) -> float:
    urls = [s.url for s in servers]
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": min(s.max_model_len for s in servers), "endpoints": urls}],
        "routing": {"policy": policy},
        "classification": {"output_budget": {"enabled": 64, "adaptive": 32, "disabled": 32}},
        "admin": {"watch_config": False},
    })
    try:
        hits0, queries0 = prefix_counters(urls)
        with httpx.Client(timeout=120) as client:
            for messages in agent_trace(seed):
                resp = client.post(gw.base_url + "/chat/completions",
                                   json={"model": MODEL, "messages": messages, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
        hits1, queries1 = prefix_counters(urls)
    finally:
        gw.stop()
    return (hits1 - hits0) / max(1.0, queries1 - queries0)


# What the feature claims (loadtests/bench/policies.py checks the same bound on the simulated benchmark).
ORACLE_SHARE = 0.95


def test_prefix_affinity_reaches_the_one_replica_oracle_on_real_prefix_hits(vllm_servers: list[Any]) -> None:
    replicas = sorted(vllm_servers, key=lambda s: s.max_model_len)[1:]  # the 4K and 8K servers form one pool
    # each run: same shape, fresh text, so nothing an earlier run cached is hit
    oracle = run_policy(replicas[:1], "round_robin", seed=13)
    round_robin = run_policy(replicas, "round_robin", seed=11)
    affinity = run_policy(replicas, "prefix_affinity", seed=12)
    print(f"real vLLM prefix hit rate: one-replica oracle {oracle:.3f}, round_robin {round_robin:.3f}, "
          f"prefix_affinity {affinity:.3f}")
    assert affinity >= ORACLE_SHARE * oracle, f"prefix_affinity {affinity:.3f} < {ORACLE_SHARE} × oracle {oracle:.3f}"
    # the trace tells routings apart: spreading sessions without regard to their prefixes falls short of the bound
    assert round_robin < ORACLE_SHARE * oracle, f"round_robin {round_robin:.3f} reaches the bound: the trace is too easy"
