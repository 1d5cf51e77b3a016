"""Precise routing checks its own hashing against the replicas' events: a replica started with another PYTHONHASHSEED
than the pool's `precise.hash_seed` publishes fresh events whose hashes the gateway can never reproduce. The gateway
hashes the first block of each prompt from the tokens in BlockStored and, when they disagree, says so (metric, log,
fallback reason `hash_mismatch`) and scores that replica approximately, while the correctly started one stays exact."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.runtime import Gateway
from policies.config import GatewayConfig
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                     "replay_endpoint": "tcp://*:0", "topic": "kv"})


@pytest.fixture(scope="module")
def sims(tiny_tokenizer_dir: Path) -> Iterator[tuple[SimProcess, SimProcess]]:
    args = ["--kv-events-config", EVENTS, "--prefix-caching-hash-algo", "sha256_cbor", "--tokenizer",
            str(tiny_tokenizer_dir), "--instant", "--kv-blocks", "512", "--mean-output-tokens", "4"]
    good = start_sim(8192, extra_args=args, env={"PYTHONHASHSEED": "7"})
    bad = start_sim(8192, extra_args=args, env={"PYTHONHASHSEED": "42"})  # not the pool's hash_seed
    try:
        yield good, bad
    finally:
        good.stop()
        bad.stop()


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_replica_hashing_with_another_seed_is_caught_and_scored_approximately(
    sims: tuple[SimProcess, SimProcess], tiny_tokenizer_dir: Path
) -> None:
    good, bad = sims
    cfg = GatewayConfig.model_validate({
        "model": MODEL,
        "pools": [{"name": "p", "max_model_len": 8192, "endpoints": [good.url, bad.url],
                   "precise": {"model_dir": str(tiny_tokenizer_dir), "hash_seed": "7", "pending_ttl_s": 0.3}}],
        "server": {"health_interval_s": 0.5},
        "admin": {"watch_config": False},
    })
    app = build_app(cfg)
    gw: Gateway = app.state.gateway
    await gw.start()
    try:
        precise = gw.precise.pools["p"]
        await _until(lambda: all(precise.index.fresh(s.url, time.monotonic()) for s in sims))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30) as c:
            served: set[str] = set()
            for i in range(24):  # distinct prompts of several blocks: rendezvous spreads them over both replicas
                system = " ".join(f"{uuid.uuid4().hex[:5]}{j} alpha{j % 7}" for j in range(200))
                r = await c.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]})
                assert r.status_code == 200
                served.add(r.headers["x-m3gate-endpoint"])
            assert served == {good.url, bad.url}
            await _until(lambda: precise.index.stale_reason(bad.url, time.monotonic()) == "hash_mismatch")
            assert precise.index.fresh(good.url, time.monotonic())
            metrics = (await c.get("/metrics")).text
        stats = {key: s for _, key, s, _ in precise.hub.iter_sources()}
        bad_stats = next(s for key, s in stats.items() if key.startswith(bad.url))
        good_stats = next(s for key, s in stats.items() if key.startswith(good.url))
        assert bad_stats.hash_mismatches >= 3 and bad_stats.hash_checks == bad_stats.hash_mismatches
        assert good_stats.hash_checks >= 1 and good_stats.hash_mismatches == 0
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(metrics) for s in family.samples}
        mismatches = {dict(labels)["endpoint"]: v for (name, labels), v in samples.items()
                      if name == "m3gate_kv_event_hash_checks_total" and dict(labels)["result"] == "mismatch"}
        assert mismatches[next(k for k in mismatches if k.startswith(bad.url))] >= 3
        assert mismatches[next(k for k in mismatches if k.startswith(good.url))] == 0
        assert samples[("m3gate_exact_index_fresh", (("endpoint", bad.url), ("pool", "p")))] == 0.0
        assert samples[("m3gate_exact_index_fresh", (("endpoint", good.url), ("pool", "p")))] == 1.0
    finally:
        await gw.stop()
