"""Keys behind Envoy: the picker checks the client's key (missing or invalid: 401 in OpenAI's shape, answered by
Envoy from the picker's ImmediateResponse), and the request reaches a key-protected replica with the POOL's key in
`authorization`, put there by the picker's header mutation; the client's credentials (`authorization`, `x-api-key`,
cookies) never reach a replica. Simulated replicas started with `--api-key` refuse anything but their pool's key; a
recording replica shows exactly which headers arrive."""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from pools.sim.launcher import SimProcess, running_sims
from tests.support.envoy import Process, start_envoy, start_picker

MODEL = "MiniMaxAI/MiniMax-M3"
CLIENT_KEY, POOL_KEY, RECORDED_POOL_KEY = "sk-client-0123456789", "pool-key-0123456789", "pool-key-recorded-0123"
SERVED = "x-gateway-destination-endpoint-served"


class HeaderRecorder:
    """A minimal vLLM stand-in that remembers the headers of every POST it answers."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._send(b"{}")

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", "0")))
                outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                self._send(json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                                       "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                           "role": "assistant", "content": "ok"}}],
                                       "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                 "total_tokens": 2}}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class KeyedPair:
    url: str
    sims: list[SimProcess]
    recorder: HeaderRecorder

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def keyed() -> Iterator[KeyedPair]:
    recorder = HeaderRecorder()
    folder = Path(tempfile.mkdtemp(prefix="m3gate-epp-keys-"))
    specs = [{"max_model_len": 32768, "extra_args": ["--speed", "20", "--api-key", POOL_KEY]}] * 2
    try:
        with running_sims(specs) as sims:
            config_path = folder / "pools.yaml"
            config_path.write_text(yaml.safe_dump({
                "model": MODEL,
                "pools": [
                    {"name": "interactive", "max_model_len": 32768, "endpoints": [s.url for s in sims],
                     "api_key": POOL_KEY},
                    {"name": "recorded", "max_model_len": 65536, "endpoints": [recorder.url],
                     "api_key": RECORDED_POOL_KEY},
                ],
                "access": {"keys": [{"name": "alice", "key_sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}]},
                "admin": {"watch_config": False},
            }, sort_keys=False))
            picker, _, epp = start_picker(folder, config_path)
            envoy: Process | None = None
            try:
                envoy, url, _ = start_envoy(folder, config_path, epp, "envoy")
                yield KeyedPair(url, sims, recorder)
            finally:
                if envoy is not None:
                    envoy.stop()
                picker.stop()
    finally:
        recorder.stop()


def _assert_openai_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"


def test_a_missing_or_invalid_key_gets_an_openai_shaped_401(keyed: KeyedPair) -> None:
    url = keyed.url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    before = sum(s.stats()["completed"] for s in keyed.sims)
    _assert_openai_401(httpx.post(url, json=body, timeout=30))
    _assert_openai_401(httpx.post(url, json=body, headers={"authorization": "Bearer sk-wrong-0123456789"}, timeout=30))
    _assert_openai_401(httpx.post(url, json=body, headers={"x-api-key": "sk-wrong-0123456789"}, timeout=30))
    with pytest.raises(openai.AuthenticationError):
        keyed.client("sk-wrong-0123456789").chat.completions.create(model=MODEL, messages=body["messages"],
                                                                    max_tokens=4)
    assert sum(s.stats()["completed"] for s in keyed.sims) == before  # no replica saw any of them


def test_a_valid_key_is_served_by_a_replica_that_requires_the_pool_key(keyed: KeyedPair) -> None:
    client = keyed.client(CLIENT_KEY)
    messages = [{"role": "user", "content": "hello with a key"}]
    before = sum(s.stats()["completed"] for s in keyed.sims)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8)
    assert raw.parse().choices[0].message.content
    assert raw.headers[SERVED] in {f"127.0.0.1:{s.port}" for s in keyed.sims}
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(s.stats()["completed"] for s in keyed.sims) - before == 2
    # the control: the replicas refuse the client's key, so what reached them was the pool's
    direct = httpx.post(keyed.sims[0].url + "/v1/chat/completions", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                        json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=30)
    assert direct.status_code == 401


def test_client_credentials_never_reach_a_replica(keyed: KeyedPair) -> None:
    """Every credential a client can send is gone, and the pool's own key (this pool's, not another's) is set."""
    seen = len(keyed.recorder.headers)
    for credentials in ({"authorization": f"Bearer {CLIENT_KEY}", "cookie": "session=secret-cookie"},
                        {"x-api-key": CLIENT_KEY, "cookie": "session=secret-cookie"}):
        answer = httpx.post(keyed.url + "/v1/chat/completions", timeout=30,
                            headers={**credentials, "x-m3gate-pool": "recorded"},
                            json={"model": MODEL, "messages": [{"role": "user", "content": "who am I"}],
                                  "max_tokens": 4})
        assert answer.status_code == 200, answer.text[:300]
    arrived = keyed.recorder.headers[seen:]
    assert len(arrived) == 2
    for headers in arrived:
        assert headers["authorization"] == f"Bearer {RECORDED_POOL_KEY}"
        assert "x-api-key" not in headers and "cookie" not in headers
        assert not any(name.startswith("x-m3gate-") for name in headers)
        assert CLIENT_KEY not in json.dumps(headers)
