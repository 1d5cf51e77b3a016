"""Secrets never leave the gateway: not in its log (traces included), /metrics, the admin API or any error body.

The gateway gets recognisable secrets — the pool's api_key (the replicas check it), the admin key, a client key
(configured as its sha256, sent by clients) and a Redis password inside `state:` — then traffic that succeeds and
fails every way the test can cause: wrong keys, the admin key offered as a client key and the other way round,
replicas answering 500, a dead replica, Redis going away and coming back (the rate limiter and shared state log it),
a config reload refused for an invalid value. Traces go to the console exporter, so they land in the same log.
Then everything the gateway said is searched for each secret and for its distinctive middle (what a masked
`abc...wxyz` form would still show is allowed, the rest is not).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.lib.private_redis import PrivateRedis
from pools.sim.launcher import SimProcess, start_sim

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

MODEL = "MiniMaxAI/MiniMax-M3"
SECRETS = {
    "pool api_key": "pk-POOLSECRET-7Hq2xZr9Lm4Vb8Nc",
    "admin key": "ak-ADMINSECRET-3Jd8Wq5Ks1Pf6Ty0",
    "client key": "ck-CLIENTSECRET-9Xe4Ru7Yo2Ig5Ah3",
    "redis password": "rp-REDISSECRET-6Fz1Cv8Bn3Mk0Gs4",
}
CLIENT = SECRETS["client key"]
ADMIN = SECRETS["admin key"]


def _config(sims: list[SimProcess], redis_url: str, **overrides: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": [s.url for s in sims],
                   "api_key": SECRETS["pool api_key"]}],
        "server": {"health_interval_s": 0.3, "upstream_read_timeout_s": 2},
        "state": redis_url,
        "admin": {"api_key": ADMIN},
        "access": {"keys": [{"name": "tenant-a", "key_sha256": hashlib.sha256(CLIENT.encode()).hexdigest(),
                             "requests_per_minute": 100_000}]},
        "telemetry": {"tracing": {"enabled": True, "exporter": "console"}},
        **overrides,
    }


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[GatewayProcess, list[SimProcess], PrivateRedis]]:
    redis = PrivateRedis(password=SECRETS["redis password"])
    redis.start()
    sims = [start_sim(32768, extra_args=["--instant", "--mean-output-tokens", "8", "--api-key",
                                         SECRETS["pool api_key"]]) for _ in range(2)]
    gw = start_gateway(_config(sims, redis.url))
    try:
        yield gw, sims, redis
    finally:
        gw.stop()
        for sim in sims:
            sim.stop()
        redis.stop()


def _forms(secret: str) -> list[str]:
    """The secret, and its middle: whatever a masked `abc...wxyz` rendering would not show."""
    return [secret, secret[3:-4]]


def test_no_secret_in_logs_metrics_admin_or_errors(setup: tuple[GatewayProcess, list[SimProcess],
                                                                 PrivateRedis]) -> None:
    gw, sims, redis = setup
    said: list[str] = []  # every response the gateway gave: status line, headers, body

    def call(method: str, path: str, **kwargs: Any) -> httpx.Response:
        resp = httpx.request(method, gw.url + path, timeout=30, **kwargs)
        said.append(f"{resp.status_code} {dict(resp.headers)} {resp.text}")
        return resp

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    ok = {"authorization": f"Bearer {CLIENT}"}
    # successes, streamed and not: the pool key goes upstream (the replicas refuse requests without it)
    assert call("POST", "/v1/chat/completions", json=chat, headers=ok).status_code == 200
    assert call("POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=ok).status_code == 200
    assert call("POST", "/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=ok).status_code == 200
    # every kind of wrong key, on both APIs
    for key in (SECRETS["pool api_key"], ADMIN, SECRETS["redis password"], CLIENT + "x", "short"):
        assert call("POST", "/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {key}"}
                    ).status_code == 401
        assert call("POST", "/v1/messages", json={**chat, "max_tokens": 4}, headers={"x-api-key": key}
                    ).status_code == 401
    for key in (CLIENT, SECRETS["pool api_key"], "wrong"):
        assert call("GET", "/admin/config", headers={"authorization": f"Bearer {key}"}).status_code == 401
    # replica failures: 500s (retried on the other replica), then a dead replica (connection refused, retried)
    sims[0].set_faults(error_rate=1.0)
    for _ in range(4):
        call("POST", "/v1/chat/completions", json=chat, headers=ok)
    sims[0].kill()
    for _ in range(4):
        call("POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=ok)
    # Redis away (the rate limiter and the shared state both log it) and back
    redis.stop()
    for _ in range(4):
        assert call("POST", "/v1/chat/completions", json=chat, headers=ok).status_code == 200
        time.sleep(0.3)
    redis.start()
    time.sleep(2.5)
    for _ in range(3):
        assert call("POST", "/v1/chat/completions", json=chat, headers=ok).status_code == 200
        time.sleep(0.5)
    # a reload refused for invalid values sitting next to the secrets
    bad = _config(sims, redis.url)
    bad["admin"] = {"api_key": ADMIN, "watch_config": ADMIN}
    bad["pools"][0]["block_size"] = SECRETS["pool api_key"]
    gw.write_config(bad)
    assert call("POST", "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 422
    gw.write_config(_config(sims, redis.url))
    call("POST", "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"})
    # everything an operator can read
    admin = {"authorization": f"Bearer {ADMIN}"}
    config = call("GET", "/admin/config", headers=admin)
    assert config.status_code == 200
    for path in ("/admin/pools", "/admin/reload", "/metrics", "/metrics/targets", "/v1/models", "/ready"):
        call("GET", path, headers=admin)
    time.sleep(1.0)  # the console exporter's batch of spans reaches the log
    log = gw.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert '"trace_id"' in log or "trace_id" in log, "tracing to the console should have written spans to the log"
    assert "**********" in config.text  # the secrets are there, masked
    leaks = [f"{name} in {where}" for name, secret in SECRETS.items() for form in _forms(secret)
             for where, text in (("the log", log), *((f"response {i}", t) for i, t in enumerate(said)))
             if form in text]
    assert not leaks, "\n".join(leaks) + "\n" + "\n".join(t[:400] for t in said if any(
        form in t for s in SECRETS.values() for form in _forms(s)))
