"""Precise prefix routing end to end over the wire, against simulated replicas that publish KV events as vLLM does
(`m3gate sim --kv-events-config ... --prefix-caching-hash-algo sha256_cbor --tokenizer DIR`): the gateway discovers
their publishers, tokenizes requests with the same tokenizer folder, and must score them from the replicas' own
events: block hashes equal to the published ones, `affinity_hit:exact`, AllBlocksCleared honoured, reloads freeing
state. The gateway runs in this process (its Starlette app over ASGI) so its decisions and index can be read."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.app import build_app
from gateway.runtime import Gateway
from policies.replica_choice import RoutingDecision
from policies.config import GatewayConfig
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                     "replay_endpoint": "tcp://*:0", "topic": "kv"})


@pytest.fixture(scope="module")
def sims(tiny_tokenizer_dir: Path) -> Iterator[list[SimProcess]]:
    args = ["--kv-events-config", EVENTS, "--prefix-caching-hash-algo", "sha256_cbor",
            "--tokenizer", str(tiny_tokenizer_dir), "--speed", "50", "--kv-blocks", "512", "--mean-output-tokens", "4"]
    with running_sims([{"max_model_len": 8192, "extra_args": args} for _ in range(2)]) as procs:
        yield list(procs)


def config(sims: list[SimProcess], tokenizer_dir: Path, **precise: Any) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "model": MODEL,
        "pools": [{"name": "p", "max_model_len": 8192, "endpoints": [s.url for s in sims],
                   "precise": {"model_dir": str(tokenizer_dir), "pending_ttl_s": 0.3, **precise}}],
        "server": {"health_interval_s": 0.5},
        "admin": {"watch_config": False},
    })


@contextlib.asynccontextmanager
async def gateway(cfg: GatewayConfig) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, list[RoutingDecision]]]:
    app = build_app(cfg)
    gw: Gateway = app.state.gateway
    await gw.start()
    decisions: list[RoutingDecision] = []
    policy = gw.policies["p"]
    choose = policy.choose

    def spy(*args: Any) -> RoutingDecision:
        decision = choose(*args)
        decisions.append(decision)
        return decision

    policy.choose = spy  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30) as c:
            yield gw, c, decisions
    finally:
        await gw.stop()


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, *({"role": "user", "content": t} for t in turns)]
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def long_text(tag: str, words: int = 250) -> str:
    return " ".join(f"{tag}{i % 37} alpha{i % 11}" for i in range(words))


async def collect_stored(endpoint: str, into: list[list[int]]) -> None:
    """A second, independent subscriber: what the replica really published."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    try:
        while True:
            _, _, payload = await sub.recv_multipart()
            for event in msgpack.unpackb(payload)[1]:
                if event["type"] == "BlockStored":
                    into.append(event["block_hashes"])
    finally:
        sub.close(0)
        ctx.term()


async def test_exact_hashes_equal_the_published_ones_and_a_shared_prefix_scores_exactly(
    sims: list[SimProcess], tiny_tokenizer_dir: Path
) -> None:
    async with gateway(config(sims, tiny_tokenizer_dir)) as (gw, client, decisions):
        precise = gw.precise.pools["p"]
        await until(lambda: all(precise.index.fresh(s.url, time.monotonic()) for s in sims))
        published: dict[str, list[list[int]]] = {s.url: [] for s in sims}
        endpoints = {s.url: httpx.get(s.url + "/kv_event_sources").json()["0"]["endpoint"] for s in sims}
        listeners = [asyncio.create_task(collect_stored(endpoints[u], published[u])) for u in published]
        await asyncio.sleep(0.2)
        computed: list[tuple[int, ...]] = []
        hashes = precise.exact_hashes

        async def spy(*args: Any) -> tuple[int, ...]:
            computed.append(await hashes(*args))
            return computed[-1]

        precise.exact_hashes = spy  # type: ignore[method-assign]
        system = long_text(uuid.uuid4().hex[:6])
        first = await client.post("/v1/chat/completions", json=chat(system, "first question"))
        assert first.status_code == 200, first.text
        target = first.headers["x-m3gate-endpoint"]
        assert decisions[-1].reason == "cold_rendezvous"
        ours = computed[-1]
        assert len(ours) >= 10
        await until(lambda: sum(map(len, published[target])) >= len(ours))
        assert tuple(h for batch in published[target] for h in batch)[: len(ours)] == ours  # block for block
        await until(lambda: precise.index.match(target, ours, time.monotonic(), pending=False) == len(ours))
        await asyncio.sleep(0.4)  # pending entries of the first request have expired: only events count now

        second = await client.post("/v1/chat/completions", json=chat(system, "a different follow-up question"))
        assert second.status_code == 200
        shared = len(list(itertools.takewhile(lambda pair: pair[0] == pair[1], zip(ours, computed[-1]))))
        assert second.headers["x-m3gate-endpoint"] == target
        assert (decisions[-1].reason, decisions[-1].matched_blocks) == ("affinity_hit:exact", shared)
        assert shared >= 9
        for task in listeners:
            task.cancel()


async def test_a_cleared_cache_is_seen_through_the_events_where_the_estimate_is_wrong(
    sims: list[SimProcess], tiny_tokenizer_dir: Path
) -> None:
    async with gateway(config(sims, tiny_tokenizer_dir)) as (gw, client, decisions):
        precise = gw.precise.pools["p"]
        await until(lambda: all(precise.index.fresh(s.url, time.monotonic()) for s in sims))
        body = chat(long_text(uuid.uuid4().hex[:6]), "question")
        first = await client.post("/v1/chat/completions", json=body)
        target = first.headers["x-m3gate-endpoint"]
        await until(lambda: precise.index.size(target) > 0)
        httpx.post(target + "/sim/reset")  # the replica's prefix cache is reset: AllBlocksCleared
        await until(lambda: precise.index.size(target) == 0)
        await asyncio.sleep(0.4)
        again = await client.post("/v1/chat/completions", json=body)
        assert again.status_code == 200
        assert decisions[-1].reason == "cold_rendezvous" and decisions[-1].matched_blocks == 0
        counters = precise.matcher.counters
        assert counters.requests_exact == 2 and counters.replicas_approx == 0


async def test_reload_and_metrics(sims: list[SimProcess], tiny_tokenizer_dir: Path) -> None:
    async with gateway(config(sims, tiny_tokenizer_dir)) as (gw, client, _):
        precise = gw.precise.pools["p"]
        await until(lambda: all(precise.index.fresh(s.url, time.monotonic()) for s in sims))
        await client.post("/v1/chat/completions", json=chat(long_text(uuid.uuid4().hex[:6]), "q"))
        text = (await client.get("/metrics")).text
        assert 'm3gate_exact_index_fresh{endpoint="%s",pool="p"} 1.0' % sims[0].url in text
        assert 'm3gate_precise_requests_total{hashes="exact",pool="p"} 1.0' in text
        assert "m3gate_kv_event_batches_total" in text
        gw.apply_config(config(sims[:1], tiny_tokenizer_dir))  # a replica leaves: its subscription and blocks go
        assert gw.precise.pools["p"] is precise
        assert precise.index.replicas() == [sims[0].url] and precise.hub.replicas() == [sims[0].url]
        gw.apply_config(config(sims[:1], tiny_tokenizer_dir, silent_after_s=3.0))  # changed settings: fresh state
        assert gw.precise.pools["p"] is not precise
        await until(lambda: gw.precise.pools["p"].index.fresh(sims[0].url, time.monotonic()))
        off = GatewayConfig.model_validate({**config(sims, tiny_tokenizer_dir).model_dump(mode="json"),
                                            "pools": [{"name": "p", "max_model_len": 8192,
                                                       "endpoints": [s.url for s in sims]}]})
        gw.apply_config(off)
        assert gw.precise.pools == {} and gw.policies["p"].prefix_index is gw.prefix_index
