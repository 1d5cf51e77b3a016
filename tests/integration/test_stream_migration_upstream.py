"""A continuation goes through the same upstream path as every request (gateway/upstream.py `Upstream.resume`): a
replica shutting down (vLLM's "cannot schedule new futures" 500) is drained, not ejected; a 4xx ejects nothing; a
/tokenize that answers 200 with no ids means that replica cannot resume the stream (the API's error event, never a silent cut); the failed
replica's in-flight count ends with its leg; a resumed stream teaches no replica latency.

Each pool has two replicas and routes round robin, so a first leg is put on the first one by a probe request that
lands on the other, and its continuation can only go to the other. The odd replica is a small HTTP server in this
process that answers as a vLLM shutting down does, or as no vLLM does (a malformed /tokenize, a 400 to every
generate request), at once and on connections the gateway already holds, which the simulator cannot."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
CHAT = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12, "ignore_eos": True,
        "chat_template_kwargs": {"thinking_mode": "disabled"}}


TOKENS = b'{"count":3,"tokens":[1,2,3]}'
BAD_REQUEST = b'{"error":{"message":"odd replica","type":"BadRequestError","param":null,"code":400}}'
REFUSAL = (b'{"error":{"message":"cannot schedule new futures after shutdown","type":"InternalServerError",'
           b'"param":null,"code":500}}')


class OddReplica:
    """/health 200, and /tokenize and generate requests answered as `tokenize` and `generate` say."""

    def __init__(self) -> None:
        self.tokenize = TOKENS
        self.generate_status, self.generate = 400, BAD_REQUEST
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._empty)
        app.router.add_get("/metrics", self._empty)
        app.router.add_post("/tokenize", self._tokenize)
        for path in ("/v1/chat/completions", "/v1/completions"):
            app.router.add_post(path, self._generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _empty(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _tokenize(self, request: web.Request) -> web.Response:
        return _answer(500 if self.tokenize == REFUSAL else 200, self.tokenize)

    async def _generate(self, request: web.Request) -> web.Response:
        return _answer(self.generate_status, self.generate)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _answer(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant"]} for _ in range(2)]) as started:
        yield started


@pytest.fixture(scope="module")
def odd() -> Iterator[OddReplica]:
    replica = OddReplica()
    yield replica
    replica.stop()


def gateway(endpoints: list[str]) -> GatewayProcess:
    return start_gateway({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": endpoints}],
        "server": {"health_interval_s": 0.5},
        "routing": {"policy": "round_robin", "migration": {"stall_timeout_s": 5}},
    })


def replicas(gw: GatewayProcess) -> dict[str, dict[str, Any]]:
    return httpx.get(gw.url + "/admin/pools", timeout=10).json()["pools"]["interactive"]["replicas"]


def next_lands_on(gw: GatewayProcess, first: str) -> None:
    """Round robin over two: a probe that lands on the other replica puts the next request on `first`."""
    for _ in range(3):
        resp = httpx.post(gw.base_url + "/chat/completions", json={"model": MODEL, **CHAT, "max_tokens": 1},
                          timeout=30)
        if resp.headers.get("x-m3gate-endpoint") != first:
            return
    raise AssertionError("round robin did not alternate")


def stream(gw: GatewayProcess, cut: int, body: dict[str, Any] = CHAT) -> tuple[str, bytes]:
    with httpx.stream("POST", gw.base_url + "/chat/completions", timeout=30,
                      json={"model": MODEL, "stream": True, "temperature": 0, **body},
                      headers={"x-sim-drop-after-chunks": str(cut)}) as resp:
        assert resp.status_code == 200
        return resp.headers["x-m3gate-endpoint"], resp.read()


def test_a_malformed_tokenize_answer_ends_the_stream_with_the_error_event(
        sims: list[SimProcess], odd: OddReplica) -> None:
    gw = gateway([sims[0].url, odd.url])
    try:
        for malformed in (b"[1,2,3]", b"not json", b'{"count":3}', b'{"tokens":["a"]}'):
            odd.tokenize = malformed
            next_lands_on(gw, sims[0].url)
            endpoint, raw = stream(gw, cut=4)  # text shown: resumed through token ids, so /tokenize on the odd one
            assert endpoint == sims[0].url
            assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n"), (malformed, raw[-300:])
        odd_state = replicas(gw)[odd.url]
        assert odd_state["ejections"] == 0 and odd_state["consecutive_failures"] == 0
    finally:
        odd.tokenize = TOKENS
        gw.stop()


def test_a_continuation_answered_with_a_4xx_ejects_no_replica(sims: list[SimProcess], odd: OddReplica) -> None:
    gw = gateway([sims[0].url, odd.url])
    try:
        odd.tokenize = TOKENS
        for cut in (2, 4):  # the chat request again (one chunk shown), a token-id continuation
            next_lands_on(gw, sims[0].url)
            _, raw = stream(gw, cut=cut)
            assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n")
        odd_state = replicas(gw)[odd.url]
        assert odd_state["ejections"] == 0 and odd_state["available"], odd_state
    finally:
        gw.stop()


def test_a_replica_shutting_down_when_the_continuation_comes_is_drained_not_ejected(
        sims: list[SimProcess], odd: OddReplica) -> None:
    """vLLM 0.32 after SIGTERM: /health 200, every new request (generate or /tokenize) a 500 "cannot schedule new
    futures after shutdown"."""
    gw = gateway([sims[0].url, odd.url])
    try:
        for drains, cut in ((1, 2), (2, 4)):  # the chat request again (one chunk shown), a token-id continuation
            next_lands_on(gw, sims[0].url)
            odd.tokenize, odd.generate_status, odd.generate = REFUSAL, 500, REFUSAL
            _, raw = stream(gw, cut=cut)
            assert b'"error"' in raw  # no other replica: the stream ends with the error event
            state = replicas(gw)[odd.url]
            assert state["ejections"] == 0 and state["drains"] == drains and state["drain_reason"], state
            odd.tokenize, odd.generate_status, odd.generate = TOKENS, 400, BAD_REQUEST
            httpx.post(gw.url + "/admin/replicas/undrain", json={"endpoint": odd.url}, timeout=10)
    finally:
        odd.tokenize, odd.generate_status, odd.generate = TOKENS, 400, BAD_REQUEST
        gw.stop()


def test_the_failed_replica_is_released_at_the_cut_and_a_resumed_stream_teaches_no_latency(
        sims: list[SimProcess]) -> None:
    gw = gateway([s.url for s in sims])
    a, b = sims
    try:
        next_lands_on(gw, b.url)
        httpx.post(gw.base_url + "/chat/completions", json={"model": MODEL, **CHAT}, timeout=30)  # b learns once
        learnt = {k: replicas(gw)[b.url][k] for k in ("prefill_s_per_token", "tpot_s")}
        next_lands_on(gw, a.url)
        b.set_faults(added_latency_ms=1500)  # the continuation waits on b: a's in-flight count is watched meanwhile
        seen: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: seen.update(answer=stream(gw, cut=4)))
        worker.start()
        time.sleep(0.8)
        during = {url: state["in_flight"] for url, state in replicas(gw).items()}
        worker.join(30)
        assert b"[DONE]" in seen["answer"][1] and b'"error"' not in seen["answer"][1]
        assert during == {a.url: 0, b.url: 1}, during
        after = replicas(gw)[b.url]
        assert {k: after[k] for k in learnt} == learnt and after["in_flight"] == 0
    finally:
        b.set_faults(added_latency_ms=0)
        gw.stop()


def test_a_client_leaving_while_the_continuation_is_opened_leaves_nothing_in_flight(sims: list[SimProcess]) -> None:
    gw = gateway([s.url for s in sims])
    a, b = sims
    try:
        next_lands_on(gw, a.url)
        b.set_faults(added_latency_ms=1500)  # the continuation waits on b when the client leaves
        with httpx.stream("POST", gw.base_url + "/chat/completions", timeout=30,
                          json={"model": MODEL, "stream": True, "temperature": 0, **CHAT},
                          headers={"x-sim-drop-after-chunks": "4"}) as resp:
            for _ in resp.iter_raw():
                break
            time.sleep(0.5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(r["in_flight"] for r in replicas(gw).values()):
            time.sleep(0.1)
        assert {url: r["in_flight"] for url, r in replicas(gw).items()} == {a.url: 0, b.url: 0}
    finally:
        b.set_faults(added_latency_ms=0)
        gw.stop()
