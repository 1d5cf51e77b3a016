"""Traffic control through a real gateway over HTTP, in front of simulated replicas: API keys (no pool ever sees a
request without a valid one), the admin API refusing client keys, per-key pools and classes, the admission queue
(waiting, 429 queue full, 503 waited too long, Retry-After, a client leaving the queue), the class priority sent to
vLLM, and input limits (messages, images, headers, a body that never arrives)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-0123456789", "admin-secret-0123456789"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
GENERATE = {
    "/chat/completions": CHAT,
    "/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 8},
    "/responses": {"model": MODEL, "input": "hello", "max_output_tokens": 8},
    "/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class RecordingReplica:
    """A minimal vLLM stand-in that remembers the bodies it was sent (to see the `priority` field)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._send(b"" if self.path == "/metrics" else b"{}", "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self._send(json.dumps({"id": "x", "object": "chat.completion", "model": MODEL, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    args = ["--mean-output-tokens", "0"]  # answers run to max_tokens: a held stream stays open
    with running_sims([{"max_model_len": 8192, "extra_args": args}, {"max_model_len": 32768, "extra_args": args}]) as s:
        yield s


@pytest.fixture(scope="module")
def recorder() -> Iterator[RecordingReplica]:
    replica = RecordingReplica()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def gateway(sims: list[SimProcess], recorder: RecordingReplica) -> Iterator[GatewayProcess]:
    gw = start_gateway({
        "model": MODEL,
        "pools": [
            {"name": "interactive", "max_model_len": 8192, "endpoints": [sims[0].url]},
            {"name": "repository", "max_model_len": 32768, "endpoints": [sims[1].url]},
            {"name": "extended", "max_model_len": 65536, "endpoints": [recorder.url], "scheduling_policy": "priority"},
        ],
        "server": {"health_interval_s": 0.3},
        "admin": {"api_key": ADMIN},
        "traffic": {"classes": {
            "interactive": {"priority": 0, "max_concurrency": 1, "queue_length": 1, "max_queue_wait_s": 1.0,
                            "spill_upward": False},
            "repository": {"priority": 1},
            "extended": {"priority": 2},
        }},
        "access": {"keys": [
            {"name": "alice", "key_sha256": _sha(ALICE), "allowed_classes": ["interactive"]},
            {"name": "bob", "key_sha256": _sha(BOB), "pools": ["interactive"], "traffic_class": "interactive"},
        ]},
        "limits": {"max_messages": 5, "max_images": 2, "max_image_data_url_bytes": 1000, "max_header_bytes": 4096,
                   "body_read_timeout_s": 0.5},
    })
    try:
        yield gw
    finally:
        gw.stop()


def _post(gw: GatewayProcess, body: dict[str, Any], key: str | None = ALICE, path: str = "/chat/completions",
          **headers: str) -> httpx.Response:
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(gw.base_url + path, json=body, headers=headers, timeout=30)


def _generate_count(sims: list[SimProcess]) -> int:
    return sum(n for s in sims for path, n in s.stats()["requests"].items() if path.startswith("/v1/"))


def _assert_openai_error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


@contextmanager
def held_stream(gw: GatewayProcess, key: str = ALICE) -> Iterator[None]:
    """Keep one interactive slot busy with a long stream until the block ends (then the client disconnects)."""
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}, timeout=30) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()  # kept referenced: a dropped iterator closes the stream
        next(chunks)  # it is upstream: the slot is taken
        yield


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        out["resp"] = fn(*args, **kwargs)
        out["s"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


# keys ---------------------------------------------------------------------------------------------------------------

def test_requests_without_a_valid_key_never_reach_a_pool(gateway: GatewayProcess, sims: list[SimProcess],
                                                         recorder: RecordingReplica) -> None:
    before, recorded = _generate_count(sims), len(recorder.bodies)
    for path, body in GENERATE.items():
        missing = _post(gateway, body, key=None, path=path)
        error = _assert_openai_error(missing, 401, "invalid_api_key")
        assert "Authorization: Bearer" in error["message"]
        _assert_openai_error(_post(gateway, body, key="sk-wrong-0123456789", path=path), 401, "invalid_api_key")
        _assert_openai_error(_post(gateway, body, key=None, path=path, **{"x-api-key": "sk-wrong-0123456789"}),
                             401, "invalid_api_key")
    forced = _post(gateway, CHAT, key="sk-wrong-0123456789", **{"x-m3gate-pool": "extended"})
    _assert_openai_error(forced, 401, "invalid_api_key")
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="sk-wrong-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert _generate_count(sims) == before and len(recorder.bodies) == recorded


def test_a_valid_key_works_from_either_sdk_header(gateway: GatewayProcess) -> None:
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key=ALICE, max_retries=0)
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message is not None
    anthropic_style = _post(gateway, GENERATE["/messages"], key=None, path="/messages",
                            **{"x-api-key": BOB, "anthropic-version": "2023-06-01"})
    assert anthropic_style.status_code == 200, anthropic_style.text


def test_the_admin_api_refuses_client_keys(gateway: GatewayProcess) -> None:
    for headers in ({"authorization": f"Bearer {ALICE}"}, {"x-api-key": ALICE}, {}):
        for method, path in (("GET", "/admin/pools"), ("GET", "/admin/config"), ("POST", "/admin/reload")):
            resp = httpx.request(method, gateway.url + path, headers=headers, timeout=5)
            _assert_openai_error(resp, 401, "invalid_admin_key")
    ok = httpx.get(gateway.url + "/admin/pools", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
    assert ok.status_code == 200 and "interactive" in ok.json()["pools"]


def test_a_key_only_reaches_its_pools_and_classes(gateway: GatewayProcess, sims: list[SimProcess]) -> None:
    before = _generate_count(sims)
    forced = _post(gateway, CHAT, key=BOB, **{"x-m3gate-pool": "repository"})
    error = _assert_openai_error(forced, 403, "pool_not_allowed")
    assert "'bob'" in error["message"] and "'interactive'" in error["message"]
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 9000}]}  # needs the repository pool
    _assert_openai_error(_post(gateway, long_prompt, key=BOB), 403, "pool_not_allowed")
    declared = _post(gateway, CHAT, key=BOB, **{"x-m3gate-class": "repository"})
    assert "x-m3gate-class" in _assert_openai_error(declared, 403, "traffic_class_not_allowed")["message"]
    assert _generate_count(sims) == before
    assert _post(gateway, {**CHAT, "max_tokens": 4}, key=ALICE, **{"x-m3gate-class": "interactive"}).status_code == 200


# admission ----------------------------------------------------------------------------------------------------------

def test_a_saturated_class_queues_then_refuses_with_retry_after(gateway: GatewayProcess) -> None:
    with held_stream(gateway):
        waiting, out = _in_thread(_post, gateway, CHAT)
        time.sleep(0.3)  # it is queued now (one place)
        full = _post(gateway, CHAT)
        error = _assert_openai_error(full, 429, "queue_full")
        assert "interactive" in error["message"]
        retry_after = int(full.headers["retry-after"])
        assert 1 <= retry_after <= 120
        time.sleep(0.2)
    waiting.join(10)
    assert out["resp"].status_code == 200, out["resp"].text  # admitted when the stream ended
    assert out["s"] >= 0.4


def test_waiting_longer_than_max_queue_wait_is_a_503_with_retry_after(gateway: GatewayProcess) -> None:
    with held_stream(gateway):
        started = time.monotonic()
        resp = _post(gateway, CHAT)
        waited = time.monotonic() - started
    error = _assert_openai_error(resp, 503, "queue_timeout")
    assert "max_queue_wait_s" in error["message"]
    assert 0.9 <= waited < 3.0
    assert 1 <= int(resp.headers["retry-after"]) <= 120


def test_a_queued_client_that_disconnects_frees_its_place(gateway: GatewayProcess, sims: list[SimProcess]) -> None:
    before = _generate_count(sims)
    with held_stream(gateway):
        payload = json.dumps(CHAT).encode()
        with socket.create_connection(("127.0.0.1", gateway.port)) as leaving:
            leaving.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            + f"authorization: Bearer {ALICE}\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
                            + payload)
            time.sleep(0.3)  # queued, holding the only place
        time.sleep(0.1)  # it hung up
        nxt, out = _in_thread(_post, gateway, CHAT)
        time.sleep(0.3)
        assert nxt.is_alive()  # queued (had the place not been freed, it would have had a 429 at once)
    nxt.join(10)
    assert out["resp"].status_code == 200, out["resp"].text
    assert _generate_count(sims) == before + 2  # the held stream and the last one: the leaver never went upstream


def test_class_priority_is_sent_to_priority_scheduling_pools(gateway: GatewayProcess,
                                                             recorder: RecordingReplica) -> None:
    forced = {"x-m3gate-pool": "extended"}
    assert _post(gateway, CHAT, **forced).status_code == 200
    assert recorder.bodies[-1]["priority"] == 2  # the extended pool's class
    no_thinking = {**CHAT, "chat_template_kwargs": {"thinking_mode": "disabled"}}
    assert _post(gateway, no_thinking, **forced).status_code == 200
    assert recorder.bodies[-1]["priority"] == 0  # latency-sensitive: the interactive priority
    declared = _post(gateway, {**CHAT, "priority": -50}, **forced, **{"x-m3gate-class": "interactive"})
    assert declared.status_code == 200 and recorder.bodies[-1]["priority"] == 0  # the client's own is replaced


# input limits -------------------------------------------------------------------------------------------------------

def test_input_limits_answer_4xx_in_openai_shape(gateway: GatewayProcess, sims: list[SimProcess]) -> None:
    before = _generate_count(sims)
    many = {**CHAT, "messages": [{"role": "user", "content": "x"}] * 6}
    assert "at most 5" in _assert_openai_error(_post(gateway, many), 400, "too_many_messages")["message"]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    images = {**CHAT, "messages": [{"role": "user", "content": [image, image, image]}]}
    _assert_openai_error(_post(gateway, images), 400, "too_many_images")
    inline = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 2000}}
    big = {**CHAT, "messages": [{"role": "user", "content": [inline]}]}
    _assert_openai_error(_post(gateway, big), 413, "image_too_large")
    _assert_openai_error(_post(gateway, CHAT, **{"x-padding": "p" * 5000}), 431, "request_headers_too_large")
    assert _generate_count(sims) == before


def test_a_body_that_never_arrives_gets_a_408(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port)) as slow:
        slow.settimeout(5)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"authorization: Bearer {ALICE}\r\ncontent-length: 100\r\n\r\n".encode() + b'{"model":')
        started = time.monotonic()
        reply = slow.recv(65536)
        waited = time.monotonic() - started
        while b"}}" not in reply and (more := slow.recv(65536)):  # the body may come in a second segment
            reply += more
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"code":"request_timeout"' in reply
    assert b"\r\nx-m3gate-refusal: request_timeout\r\n" in reply  # as on every refusal: the code, by header
    assert 0.4 <= waited < 3
