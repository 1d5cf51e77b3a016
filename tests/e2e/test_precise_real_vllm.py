"""Precise prefix routing against REAL vLLM CPU servers (the session's, started with KV events on and
`--prefix-caching-hash-algo sha256_cbor`): the block hashes the gateway computes for a chat request from the model
folder's own tokenizer and chat template must equal, block for block, the `block_hashes` the replica publishes in its
BlockStored events; and a second request sharing the prefix must be scored with the exact matched length.

The gateway runs in this process (its Starlette app over ASGI) so that its computed hashes and routing decisions can
be read; the replicas' events are also read by an independent ZMQ subscriber, as ground truth."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable
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

pytestmark = pytest.mark.vllm

MODEL = "MiniMaxAI/MiniMax-M3"


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def listen(port: int, events: list[dict[str, Any]]) -> None:
    """Every BlockStored the replica publishes (an independent subscriber on its PUB port)."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        while True:
            _, _, payload = await sub.recv_multipart()
            events.extend(e for e in msgpack.unpackb(payload, strict_map_key=False)[1]
                          if isinstance(e, dict) and e.get("type") == "BlockStored")
    finally:
        sub.close(0)
        ctx.term()


def published_chain(events: list[dict[str, Any]], first: int) -> list[int]:
    """The chain of published block hashes that starts at `first` (a first block: parent None), following parents
    across batches (vLLM stores a long prefill in chunks)."""
    chain: list[int] = []
    for event in events:
        hashes = list(event["block_hashes"])
        if not chain and event.get("parent_block_hash") is None and hashes and hashes[0] == first:
            chain = hashes
        elif chain and event.get("parent_block_hash") == chain[-1]:
            chain += hashes
    return chain


def text(tag: str, words: int) -> str:
    vocab = "the model reads a long file and writes a short patch for the failing test in the repository".split()
    return tag + " " + " ".join(vocab[(i * 7) % len(vocab)] for i in range(words))


async def test_gateway_block_hashes_equal_the_replicas_published_ones(vllm_servers: list[Any]) -> None:
    servers = sorted(vllm_servers, key=lambda s: s.max_model_len)[:2]
    config = GatewayConfig.model_validate({
        "model": MODEL,
        "pools": [{
            "name": "p", "max_model_len": min(s.max_model_len for s in servers), "endpoints": [s.url for s in servers],
            # endpoints discovered from each replica's /kv_event_sources (tcp://*:PORT → its host)
            "precise": {"model_dir": str(servers[0].model_dir), "pending_ttl_s": 0.5},
        }],
        "server": {"health_interval_s": 0.5},
        "admin": {"watch_config": False},
    })
    published: dict[str, list[dict[str, Any]]] = {s.url: [] for s in servers}
    listeners = [asyncio.create_task(listen(s.ports["kv_port"], published[s.url])) for s in servers]
    app = build_app(config)
    gw: Gateway = app.state.gateway
    await gw.start()
    try:
        precise = gw.precise.pools["p"]
        await until(lambda: all(precise.index.fresh(s.url, time.monotonic()) for s in servers))
        computed: list[tuple[int, ...]] = []
        decisions: list[RoutingDecision] = []
        exact_hashes, choose = precise.exact_hashes, gw.policies["p"].choose

        async def spy_hashes(*args: Any) -> tuple[int, ...]:
            computed.append(await exact_hashes(*args))
            return computed[-1]

        def spy_choose(*args: Any) -> RoutingDecision:
            decisions.append(choose(*args))
            return decisions[-1]

        precise.exact_hashes = spy_hashes  # type: ignore[method-assign]
        gw.policies["p"].choose = spy_choose  # type: ignore[method-assign]
        system = text(uuid.uuid4().hex, 700)  # a prefix no earlier test can have cached
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=120) as client:
            first = await client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 4,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "What fails?"}]})
            assert first.status_code == 200, first.text
            target = first.headers["x-m3gate-endpoint"]
            ours = computed[-1]
            prompt_tokens = first.json()["usage"]["prompt_tokens"]
            assert len(ours) == prompt_tokens // 128 >= 4

            # what the replica published for this prompt, block for block
            await until(lambda: len(published_chain(published[target], ours[0])) >= len(ours))
            assert tuple(published_chain(published[target], ours[0])[: len(ours)]) == ours
            assert all(ours[0] not in e["block_hashes"] for s, evs in published.items() if s != target for e in evs)

            # the gateway's own subscriber saw the same; once the pending entries expire only events count
            await until(lambda: precise.index.match(target, ours, time.monotonic(), pending=False) == len(ours))
            await asyncio.sleep(0.6)
            second = await client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 4,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Which patch fixes it, and why?"}]})
            assert second.status_code == 200, second.text
            shared = len(list(itertools.takewhile(lambda ab: ab[0] == ab[1], zip(ours, computed[-1]))))
            assert shared >= len(ours) - 1
            decision = decisions[-1]
            assert second.headers["x-m3gate-endpoint"] == target
            assert (decision.reason, decision.matched_blocks) == ("affinity_hit:exact", shared)
            cached = second.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
            assert cached == shared * 128  # vLLM's own count agrees with the exact match
    finally:
        await gw.stop()
        for task in listeners:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*listeners, return_exceptions=True)
