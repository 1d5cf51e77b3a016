"""The relay under real failures of simulated replicas: byte-faithful streams, aborts on disconnect, retries before
the first byte, SSE error events after it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.replicas import EJECT_AFTER_5XX
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}
READ_TIMEOUT_S = 1.5  # server.upstream_read_timeout_s: how long a replica that never answers is waited for


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--speed", "20"]} for _ in range(2)]) as sims:
        yield sims


@pytest.fixture
def gateway(replicas: list[SimProcess]) -> Iterator[GatewayProcess]:
    """A gateway per test: no replica starts ejected (with its back-off) by the faults of the test before."""
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [s.url for s in replicas]}],
        "server": {"health_interval_s": 0.3, "upstream_read_timeout_s": READ_TIMEOUT_S},
        "classification": {"output_budget": {"adaptive": 512, "enabled": 1024, "disabled": 256}},
    })
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(autouse=True)
def healthy_replicas(replicas: list[SimProcess]) -> Iterator[None]:
    for sim in replicas:
        sim.set_faults(error_rate=0.0, hang=False, drop_mid_stream=0.0, drop_after_chunks=None, unhealthy=False,
                       added_latency_ms=0)
    time.sleep(0.4)
    yield
    for sim in replicas:
        sim.set_faults(error_rate=0.0, hang=False, drop_mid_stream=0.0, drop_after_chunks=None, unhealthy=False,
                       added_latency_ms=0)


def _normalise(sse: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', sse)


def test_stream_is_byte_identical_to_the_replicas(gateway: GatewayProcess, replicas: list[SimProcess]) -> None:
    body = {**CHAT, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}, "seed": 7}
    via = httpx.post(gateway.base_url + "/chat/completions", json=body, headers={"x-request-id": "same-id"}, timeout=30)
    replica = via.headers["x-m3gate-endpoint"]
    direct = httpx.post(replica + "/v1/chat/completions", json=body, headers={"x-request-id": "same-id"}, timeout=30)
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert _normalise(via.content) == _normalise(direct.content)
    assert via.content.endswith(b"data: [DONE]\n\n")


def test_client_disconnect_aborts_the_upstream_request(gateway: GatewayProcess, replicas: list[SimProcess]) -> None:
    before = {s.url: s.stats()["aborted"] for s in replicas}
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", gateway.base_url + "/chat/completions", json=body, timeout=30) as resp:
        replica = resp.headers["x-m3gate-endpoint"]
        for i, _ in enumerate(resp.iter_raw()):
            if i >= 2:
                break
    sim = next(s for s in replicas if s.url == replica)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sim.stats()["aborted"] == before[replica]:
        time.sleep(0.05)
    stats = sim.stats()
    assert stats["aborted"] == before[replica] + 1
    assert stats["running"] == 0


def test_5xx_before_first_byte_is_retried_on_the_other_replica(
    gateway: GatewayProcess, replicas: list[SimProcess]
) -> None:
    broken, good = replicas
    broken.set_faults(error_rate=1.0)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    started = time.monotonic()
    for i in range(12):
        raw = client.chat.completions.with_raw_response.create(**CHAT, max_tokens=4, stream=bool(i % 2))
        assert raw.status_code == 200
        assert raw.headers["x-m3gate-endpoint"] == good.url
    # ejected after EJECT_AFTER_5XX answered 5xx in a row, then with exponential back-off (1 s, 2 s, 4 s ...):
    # retried about log2(elapsed) more times, not once per request
    elapsed = time.monotonic() - started
    # tried until ejected (each 5xx then served by the other replica counts against it), and not much more
    assert EJECT_AFTER_5XX <= broken.stats()["injected_errors"] <= EJECT_AFTER_5XX + int(elapsed).bit_length()


def test_hung_replica_times_out_and_is_retried(gateway: GatewayProcess, replicas: list[SimProcess]) -> None:
    """A replica that accepts the request and never answers costs the read timeout; the request is then retried on
    the other replica, unseen: the client gets that replica's 200."""
    hung, good = replicas
    hung.set_faults(hang=True)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30)
    for _ in range(6):  # the policy may choose either replica first
        before = hung.stats()["hung"]
        started = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(**CHAT, max_tokens=4)
        elapsed = time.monotonic() - started
        assert raw.status_code == 200 and raw.headers["x-m3gate-endpoint"] == good.url
        if hung.stats()["hung"] > before:
            break
    else:
        pytest.fail("no request reached the hung replica")
    assert hung.stats()["hung"] == before + 1
    assert READ_TIMEOUT_S <= elapsed < READ_TIMEOUT_S + 5  # waited for the hung replica, then answered at once


@pytest.mark.parametrize("stream", [False, True])
def test_a_pool_of_hung_replicas_answers_504_upstream_timeout(
    gateway: GatewayProcess, replicas: list[SimProcess], stream: bool
) -> None:
    for sim in replicas:
        sim.set_faults(hang=True)
    before = sum(s.stats()["hung"] for s in replicas)
    started = time.monotonic()
    resp = httpx.post(gateway.base_url + "/chat/completions", json={**CHAT, "max_tokens": 4, "stream": stream},
                      timeout=30)
    elapsed = time.monotonic() - started
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"
    assert resp.json()["error"]["type"] == "timeout_error"
    assert sum(s.stats()["hung"] for s in replicas) == before + 2  # both replicas were tried
    assert 2 * READ_TIMEOUT_S <= elapsed < 2 * READ_TIMEOUT_S + 5


def test_mid_stream_failure_ends_with_an_sse_error_event(gateway: GatewayProcess, replicas: list[SimProcess]) -> None:
    for sim in replicas:
        sim.set_faults(drop_mid_stream=1.0)
    resp = httpx.post(gateway.base_url + "/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True},
                      timeout=30)
    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert b'"error"' in events[-2]
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(**CHAT, max_tokens=200, stream=True):
            pass


def test_killed_replica_costs_no_request() -> None:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant"]} for _ in range(2)]) as sims:
        gw = start_gateway({"model": MODEL, "pools": [
            {"name": "interactive", "max_model_len": 8192, "endpoints": [s.url for s in sims]}],
            "server": {"health_interval_s": 0.3}})
        try:
            client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
            sims[0].kill()
            served = [client.chat.completions.with_raw_response.create(**CHAT, max_tokens=2).headers[
                "x-m3gate-endpoint"] for _ in range(10)]
            assert set(served) == {sims[1].url}
        finally:
            gw.stop()


def test_unhealthy_replica_is_avoided(gateway: GatewayProcess, replicas: list[SimProcess]) -> None:
    sick, good = replicas
    sick.set_faults(unhealthy=True)  # /health 503, requests still answered: only its next probe shows it
    deadline = time.monotonic() + 16 * 0.3 + 2.0  # an idle replica's probes back off to 16 health intervals
    while httpx.get(gateway.url + "/admin/pools").json()["pools"]["interactive"]["replicas"][sick.url]["healthy"]:
        assert time.monotonic() < deadline, "the unhealthy replica was not found"
        time.sleep(0.1)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    served = {client.chat.completions.with_raw_response.create(**CHAT, max_tokens=2).headers["x-m3gate-endpoint"]
              for _ in range(6)}
    assert served == {good.url}


def test_non_streaming_client_disconnect_aborts_the_upstream_request(
    gateway: GatewayProcess, replicas: list[SimProcess]
) -> None:
    before = sum(s.stats()["aborted"] for s in replicas)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.base_url + "/chat/completions", json={**CHAT, "max_tokens": 4000, "ignore_eos": True},
                   timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(s.stats()["aborted"] for s in replicas) == before:
        time.sleep(0.05)
    assert sum(s.stats()["aborted"] for s in replicas) == before + 1
    assert all(s.stats()["running"] == 0 for s in replicas)
    pools = httpx.get(gateway.url + "/admin/pools").json()["pools"]
    assert all(r["in_flight"] == 0 for r in pools["interactive"]["replicas"].values())


def test_replica_dying_before_the_first_token_is_retried_unseen(
    gateway: GatewayProcess, replicas: list[SimProcess]
) -> None:
    """The client's 200 waits for the first token: a replica that drops the stream before any event (here: its
    headers sent, then the connection cut at once) costs the client nothing."""
    for sim in replicas:
        sim.set_faults(added_latency_ms=0)
    broken, good = replicas
    broken.set_faults(drop_mid_stream=1.0, drop_after_chunks=0)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    dropped_before = broken.stats()["dropped"]
    for _ in range(4):
        chunks = list(client.chat.completions.create(**CHAT, max_tokens=8, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert broken.stats()["dropped"] > dropped_before, "the broken replica was never tried"
