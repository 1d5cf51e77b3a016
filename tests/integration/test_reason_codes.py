"""Reason-coded answers through a real gateway over HTTP in front of a simulated replica: every refusal repeats its
error body's `code` in `x-m3gate-refusal`, and every answer, served or refused, streamed or not, says in
`x-m3gate-queue-ms` how long it waited in the gateway's admission queue (0 when it did not)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
ALICE, CAROL = "sk-alice-0123456789", "sk-carol-0123456789"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
HOLD_S = 0.6  # how long a held stream keeps the only slot busy while another request waits


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    args = ["--mean-output-tokens", "0"]  # answers run to max_tokens: a held stream stays open
    with running_sims([{"max_model_len": 8192, "extra_args": args}]) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [sims[0].url]}],
            "server": {"health_interval_s": 0.3},
            "traffic": {"classes": {"interactive": {"max_concurrency": 1, "queue_length": 1, "max_queue_wait_s": 1.0,
                                                    "spill_upward": False}}},
            "access": {"keys": [
                {"name": "alice", "key_sha256": hashlib.sha256(ALICE.encode()).hexdigest()},
                {"name": "carol", "key_sha256": hashlib.sha256(CAROL.encode()).hexdigest(),
                 "requests_per_minute": 1},
            ]},
        })
        try:
            yield gw
        finally:
            gw.stop()


def _post(gw: GatewayProcess, body: dict[str, Any] = CHAT, key: str | None = ALICE) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)


@contextmanager
def held_slot(gw: GatewayProcess) -> Iterator[None]:
    """The class's only slot busy with a long stream until the block ends (then the client disconnects)."""
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body,
                      headers={"authorization": f"Bearer {ALICE}"}, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-m3gate-queue-ms"] == "0"  # it found the slot free
        chunks = resp.iter_raw()  # kept referenced: a dropped iterator closes the stream
        next(chunks)
        yield


def _later(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    return thread, out


def _refusal(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code
    assert resp.headers["x-m3gate-refusal"] == code


def test_a_served_request_that_did_not_wait_says_zero(gateway: GatewayProcess) -> None:
    resp = _post(gateway)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-m3gate-queue-ms"] == "0"
    assert "x-m3gate-refusal" not in resp.headers


def test_a_queued_non_streamed_request_reports_its_wait_and_the_next_gets_queue_full(gateway: GatewayProcess) -> None:
    with held_slot(gateway):
        waiting, out = _later(lambda: _post(gateway))
        time.sleep(0.3)  # queued now, in the only place
        full = _post(gateway)
        _refusal(full, 429, "queue_full")
        assert full.headers["x-m3gate-queue-ms"] == "0"  # refused without waiting
        time.sleep(HOLD_S - 0.3)
    waiting.join(10)
    served = out["value"]
    assert served.status_code == 200, served.text
    assert HOLD_S * 1000 * 0.8 <= float(served.headers["x-m3gate-queue-ms"]) < 5000
    assert "x-m3gate-refusal" not in served.headers


def test_a_queued_stream_reports_its_wait_through_the_sdk(gateway: GatewayProcess) -> None:
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key=ALICE, max_retries=0)

    def stream() -> tuple[httpx.Headers, str]:
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
        return raw.headers, text

    with held_slot(gateway):
        waiting, out = _later(stream)
        time.sleep(HOLD_S)
    waiting.join(10)
    headers, text = out["value"]
    assert text
    assert HOLD_S * 1000 * 0.8 <= float(headers["x-m3gate-queue-ms"]) < 5000


def test_a_request_that_waited_too_long_is_a_queue_timeout_with_its_wait(gateway: GatewayProcess) -> None:
    with held_slot(gateway):
        resp = _post(gateway)
    _refusal(resp, 503, "queue_timeout")
    assert 900 <= float(resp.headers["x-m3gate-queue-ms"]) < 3000  # max_queue_wait_s: 1.0


def test_a_rate_limited_request_names_its_code(gateway: GatewayProcess) -> None:
    assert _post(gateway, key=CAROL).status_code == 200
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key=CAROL, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    headers = refused.value.response.headers
    assert refused.value.code == "rate_limit_exceeded"
    assert headers["x-m3gate-refusal"] == "rate_limit_exceeded" and headers["x-m3gate-queue-ms"] == "0"
    assert int(headers["retry-after"]) >= 1


def test_refusals_before_admission_carry_their_code(gateway: GatewayProcess) -> None:
    _refusal(_post(gateway, key=None), 401, "invalid_api_key")
    _refusal(_post(gateway, {**CHAT, "model": "other"}), 404, "model_not_found")
