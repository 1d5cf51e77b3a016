"""Per-key rate limits over real HTTP: one quota shared by two gateway processes through the real Redis (db 8, a key
prefix of this run), OpenAI's 429 and x-ratelimit-* headers, and the fall back to per-process limits while a Redis
(our own redis-server, never the shared one) is down — and back to Redis when it returns."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.cli.launcher import GatewayProcess, free_port, start_gateway
from pools.sim.launcher import SimProcess, running_sims
from tests.support.tools import require_tools

MODEL = "MiniMaxAI/MiniMax-M3"
KEY = "sk-limited-0123456789"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
SHARED_REDIS = "redis://127.0.0.1:6379/8"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant"]}]) as sims:
        yield sims[0]


def _config(sim: SimProcess, redis_url: str, prefix: str, **key: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [sim.url]}],
        "server": {"health_interval_s": 0.5},
        "access": {
            "keys": [{"name": "limited", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(), **key}],
            "rate_limit_redis": redis_url, "rate_limit_prefix": prefix, "redis_retry_s": 0.5,
        },
    }


def _post(gw: GatewayProcess, body: dict[str, Any] = CHAT) -> httpx.Response:
    return httpx.post(gw.base_url + "/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"},
                      timeout=30)


def test_limits_hold_across_two_gateways_sharing_redis(sim: SimProcess) -> None:
    prefix = f"m3gate-test:{uuid.uuid4().hex}:"
    config = _config(sim, SHARED_REDIS, prefix, requests_per_minute=4, tokens_per_minute=100_000)
    first = start_gateway(config)
    second = start_gateway(config)
    try:
        replies = [_post(gw) for gw in (first, second, first, second, first, second)]
    finally:
        first.stop()
        second.stop()
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 429, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies[:4]] == ["3", "2", "1", "0"]
    for ok in replies[:4]:
        assert ok.headers["x-ratelimit-limit-requests"] == "4"
        assert ok.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 100_000
        assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
    refused = replies[4]
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "'limited'" in error["message"] and "try again in" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 15  # one request regained every 15 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    keys = redis.Redis.from_url(SHARED_REDIS).keys(prefix + "*")
    # one requests counter for both gateways (the tokens one may have expired already: ~100 tokens of 100,000/min
    # are regained in well under a second)
    assert b"req" in [k.rsplit(b":", 1)[1] for k in keys] and len(keys) <= 2


def test_a_request_larger_than_the_token_limit_is_refused_outright(sim: SimProcess) -> None:
    prefix = f"m3gate-test:{uuid.uuid4().hex}:"
    gw = start_gateway(_config(sim, SHARED_REDIS, prefix, tokens_per_minute=500))
    try:
        ok = _post(gw, {**CHAT, "max_tokens": 100})
        too_big = _post(gw, {**CHAT, "max_tokens": 1000})
        after_ok = [_post(gw, {**CHAT, "max_tokens": 100}) for _ in range(4)]
    finally:
        gw.stop()
    assert ok.status_code == 200 and "x-ratelimit-limit-requests" not in ok.headers
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) <= 400
    error = too_big.json()["error"]
    assert too_big.status_code == 429 and error["type"] == "tokens" and "max_tokens" in error["message"]
    assert "retry-after" not in too_big.headers  # waiting would not help
    assert 429 in [r.status_code for r in after_ok]  # 500 tokens/min run out after a few ~110-token requests


@pytest.fixture
def own_redis() -> Iterator[dict[str, Any]]:
    """A redis-server of this test's own on a free port: stopped and restarted by PID (never the shared one)."""
    require_tools("redis-server")
    binary = shutil.which("redis-server")
    assert binary is not None
    port = free_port()
    state: dict[str, Any] = {"port": port, "url": f"redis://127.0.0.1:{port}/0"}

    def start() -> None:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        state["proc"] = proc
        client = redis.Redis(port=port, socket_timeout=0.5)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("own redis-server did not start")

    def stop() -> None:
        proc: subprocess.Popen[bytes] = state["proc"]
        proc.terminate()
        proc.wait(5)

    state["start"], state["stop"] = start, stop
    start()
    try:
        yield state
    finally:
        if state["proc"].poll() is None:
            stop()


def test_limits_fall_back_to_memory_while_redis_is_down(sim: SimProcess, own_redis: dict[str, Any]) -> None:
    prefix = "m3gate-test:fallback:"
    gw = start_gateway(_config(sim, own_redis["url"], prefix, requests_per_minute=3))
    counters = redis.Redis.from_url(own_redis["url"])
    try:
        assert [_post(gw).status_code for _ in range(2)] == [200, 200]
        assert counters.keys(prefix + "*")  # counted in Redis

        own_redis["stop"]()
        down = [_post(gw) for _ in range(5)]
        # memory takes over at once: no request fails for Redis, and the key's 3 per minute still hold here
        assert [r.status_code for r in down] == [200, 200, 200, 429, 429]
        assert down[3].json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in down[3].headers
        assert gw.log_tail(200).count("counting in this process only") == 1

        own_redis["start"]()  # an empty Redis again (no persistence)
        time.sleep(0.6)  # redis_retry_s
        back = _post(gw)
        assert back.status_code == 200 and back.headers["x-ratelimit-remaining-requests"] == "2"
        assert counters.keys(prefix + "*")  # counted in Redis again
        assert "limits are shared across gateways again" in gw.log_tail(200)
    finally:
        gw.stop()
