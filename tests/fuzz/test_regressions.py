"""Regressions for defects the fuzz suite found in the gateway (each fixed where it lived)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, start_sim

pytestmark = [pytest.mark.fuzz]

MODEL = "MiniMaxAI/MiniMax-M3"


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    sim: SimProcess = start_sim(32768, extra_args=["--instant", "--mean-output-tokens", "4"])
    gw = start_gateway({"model": MODEL, "aliases": ["m3"],
                        "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": [sim.url]}],
                        "limits": {"body_read_timeout_s": 1.0}})
    try:
        yield gw
    finally:
        gw.stop()
        sim.stop()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b'{"model": "%s", "stream": true, "max_tokens": 2, "messages": [{"role": "user", '
                             b'"content": "hi"}], "x": %s}' % (MODEL.encode(), _nested(300))),
    ("/v1/chat/completions", b'{"model": "m3", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
                             b'"x": %s}' % _nested(1000)),
    ("/tokenize", b'{"model": "m3", "prompt": %s}' % _nested(300)),
])
def test_json_nested_too_deep_to_forward_is_a_400(gateway: GatewayProcess, path: str, body: bytes) -> None:
    """Defect: orjson reads 1024 levels but writes only 255, and the gateway writes a body back whenever it changes
    it (alias → model id, stream_options for a stream, /tokenize): a body nested 256-1024 deep got a 500."""
    resp = httpx.post(gateway.url + path, content=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_json"
    ok = httpx.post(gateway.url + path, timeout=10, content=body.replace(_nested(300), _nested(200))
                    .replace(_nested(1000), _nested(200)))
    assert ok.status_code in (200, 400) and ok.status_code != 500


def _connect(gw: GatewayProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
    return s


def test_a_connection_that_never_sends_is_closed_with_a_408(gateway: GatewayProcess) -> None:
    """Defect: uvicorn waits forever for a request head, so idle connections and slowloris headers each held a
    socket for good. Now the head must arrive within limits.body_read_timeout_s."""
    with _connect(gateway) as idle, _connect(gateway) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for s in (idle, slow):
            data = s.recv(4096)
            assert data.startswith(b"HTTP/1.1 408"), data
            assert b'"type":"invalid_request_error"' in data and b'"code":"request_timeout"' in data
            assert b"\r\nx-m3gate-refusal: request_timeout\r\n" in data.split(b"\r\n\r\n")[0] + b"\r\n"
            assert s.recv(4096) == b""  # and closed
        assert time.monotonic() - started < 4


def test_a_kept_alive_connection_is_not_cut_by_the_head_deadline(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(0.6)  # 1.8 s over one connection, longer than the 1 s head deadline


def test_a_malformed_request_gets_an_openai_shaped_400(gateway: GatewayProcess) -> None:
    with _connect(gateway) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Evil: a\rX-Injected: 1\r\n\r\n")
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 400"), data
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"x-injected" not in head.lower()
    assert b'"error":{"message":"Malformed HTTP request' in body


def test_a_slow_body_to_tokenize_gets_a_408(gateway: GatewayProcess) -> None:
    """Defect: /tokenize read its body with no deadline (the generate endpoints had one): a client trickling a body
    held a connection and a task forever."""
    with _connect(gateway) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 50\r\n\r\n{")
        s.settimeout(0.2)
        started, data = time.monotonic(), b""
        while time.monotonic() - started < 5 and not data:
            try:
                data = s.recv(4096)
            except TimeoutError:
                s.sendall(b" ")
    assert data.startswith(b"HTTP/1.1 408"), data
    assert time.monotonic() - started < 3
