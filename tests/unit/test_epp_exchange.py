"""The endpoint picker's ext_proc exchange, driven in process with the messages Envoy sends (no Envoy, no replica:
the picker only decides, and its decisions are what is checked): every body obeys `server.max_body_bytes`, a bug
while deciding is an OpenAI-shaped 500 counted as one, and Envoy's retries blame a replica by `serve`'s rule."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from gateway.epp import wire
from gateway.app import build_app
from gateway.epp.picker import EndpointPicker
from policies.config import GatewayConfig
from pools.replicas import EJECT_AFTER_5XX

pytestmark = pytest.mark.asyncio

MODEL = "MiniMaxAI/MiniMax-M3"
REPLICAS = ["127.0.0.1:1001", "127.0.0.1:1002"]  # never called: Envoy (here, the test) sends the requests
LIMIT = 50_000


def _picker() -> EndpointPicker:
    config = GatewayConfig.model_validate({
        "model": MODEL, "server": {"max_body_bytes": LIMIT},
        "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": [f"http://{r}" for r in REPLICAS]}]})
    app = build_app(config)
    return EndpointPicker(app.state.coordinator, app)


class Stream:
    """Envoy's side of one ext_proc stream: messages in, the picker's replies out, open until `end`."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.inbox: asyncio.Queue[ext.ProcessingRequest | None] = asyncio.Queue()
        self.replies: asyncio.Queue[ext.ProcessingResponse] = asyncio.Queue()
        self.task = asyncio.ensure_future(picker.Process(self._messages(), self))

    async def _messages(self) -> AsyncIterator[ext.ProcessingRequest]:
        while (message := await self.inbox.get()) is not None:
            yield message

    async def write(self, reply: ext.ProcessingResponse) -> None:  # the gRPC context's
        await self.replies.put(reply)

    async def send(self, message: ext.ProcessingRequest) -> None:
        await self.inbox.put(message)

    async def reply(self) -> ext.ProcessingResponse:
        return await asyncio.wait_for(self.replies.get(), 5)

    async def end(self) -> None:
        await self.inbox.put(None)
        await asyncio.wait_for(self.task, 5)


def _headers(path: str, end: bool = False, **extra: str) -> ext.ProcessingRequest:
    pairs = {":method": "POST", ":path": path, ":scheme": "http", ":authority": "gw",
             "content-type": "application/json", **extra}
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ext.ProcessingRequest(request_headers=ext.HttpHeaders(headers=base_pb2.HeaderMap(headers=values),
                                                                 end_of_stream=end))


def _body(data: bytes, end: bool) -> ext.ProcessingRequest:
    return ext.ProcessingRequest(request_body=ext.HttpBody(body=data, end_of_stream=end))


def _error(reply: ext.ProcessingResponse, status: int) -> dict[str, Any]:
    """The ImmediateResponse's OpenAI-shaped error."""
    assert reply.WhichOneof("response") == "immediate_response", reply
    answer = reply.immediate_response
    assert answer.status.code == status
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


async def _requests_total(picker: EndpointPicker, status: str) -> float:
    """m3gate_requests_total for `status`, as /metrics publishes it."""
    transport = httpx.ASGITransport(app=picker.app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("m3gate_requests_total{") and f'status="{status}"' in line)


@pytest.mark.parametrize("path", ["/tokenize", "/v1/unknown-post", "/v1/chat/completions"])
async def test_every_body_obeys_max_body_bytes_as_it_streams_in(path: str) -> None:
    """A body past the limit is refused at the chunk that crosses it, before it ends (the picker would otherwise
    hold all of it), on a path that needs no replica as on a generate path."""
    stream = Stream(_picker())
    await stream.send(_headers(path))
    await stream.send(_body(b"x" * (LIMIT // 2), end=False))
    await stream.send(_body(b"x" * (LIMIT // 2 + 1), end=False))  # over the limit, and the body goes on
    assert _error(await stream.reply(), 413)["code"] == "request_too_large"
    await stream.end()


@pytest.mark.parametrize("path", ["/tokenize", "/v1/unknown-post"])
async def test_a_declared_body_past_the_limit_is_refused_from_its_headers(path: str) -> None:
    stream = Stream(_picker())
    await stream.send(_headers(path, **{"content-length": str(LIMIT + 1)}))
    assert _error(await stream.reply(), 413)["code"] == "request_too_large"
    await stream.end()


async def test_a_bug_while_deciding_is_an_openai_500_logged_and_counted_as_500(
        caplog: pytest.LogCaptureFixture) -> None:
    picker = _picker()
    before = await _requests_total(picker, "500"), await _requests_total(picker, "499")

    async def broken(*args: Any, **kwargs: Any) -> Any:  # a gateway bug cannot be made on demand: injected
        raise RuntimeError("a bug in the coordinator")

    picker.coordinator.prepare = broken  # type: ignore[method-assign]
    stream = Stream(picker)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    with caplog.at_level(logging.ERROR, logger="m3gate.epp"):
        await stream.send(_headers("/v1/chat/completions"))
        await stream.send(_body(body, end=True))
        assert _error(await stream.reply(), 500)["type"] == "server_error"
        await stream.end()
    assert any("a bug in the coordinator" in (r.exc_text or "") for r in caplog.records)
    assert (await _requests_total(picker, "500"), await _requests_total(picker, "499")) == (before[0] + 1, before[1])


async def _served_elsewhere(picker: EndpointPicker, status: int) -> str:
    """One chat request: the picker's pick, then Envoy's answer from the other replica (its retry) with `status`.
    Returns the pick."""
    stream = Stream(picker)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "The same long question. " * 200}],
                       "max_tokens": 4}).encode()
    await stream.send(_headers("/v1/chat/completions"))
    await stream.send(_body(body, end=True))
    pick = await stream.reply()
    destinations = pick.dynamic_metadata.fields[wire.LB_NAMESPACE].struct_value.fields[wire.DESTINATION_HEADER]
    first, fallback = destinations.string_value.split(",")
    await stream.reply()  # the body
    metadata = struct_pb2.Struct()
    metadata.update({wire.LB_NAMESPACE: {wire.SERVED_KEY: fallback}})
    pairs = [base_pb2.HeaderValue(key=k, raw_value=v.encode())
             for k, v in {":status": str(status), "content-type": "application/json"}.items()]
    await stream.send(ext.ProcessingRequest(
        response_headers=ext.HttpHeaders(headers=base_pb2.HeaderMap(headers=pairs)),
        metadata_context=base_pb2.Metadata(filter_metadata={wire.LB_NAMESPACE: metadata.fields[
            wire.LB_NAMESPACE].struct_value})))
    await stream.reply()
    answer = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}
    await stream.send(ext.ProcessingRequest(response_body=ext.HttpBody(
        body=json.dumps(answer if status == 200 else {"error": {"message": "x"}}).encode(), end_of_stream=True)))
    await stream.reply()
    await stream.end()
    return first


async def test_an_envoy_retry_blames_the_pick_as_serve_blames_an_answered_5xx() -> None:
    """Envoy's retry served by the fallback counts as one answered 5xx of the pick: out of rotation only after
    EJECT_AFTER_5XX in a row, as `m3gate serve` does; a retry the fallback fails too blames nobody."""
    picker = _picker()
    replicas = {r.url.removeprefix("http://"): r for r in picker.gw.pools["interactive"].replicas.values()}
    now = picker.gw.clock
    assert await _served_elsewhere(picker, 502) in replicas
    assert all(r.consecutive_failures == 0 and r.is_available(now()) for r in replicas.values())
    picks = []
    for _ in range(EJECT_AFTER_5XX):
        assert all(r.is_available(now()) for r in replicas.values())
        picks.append(await _served_elsewhere(picker, 200))
    assert len(set(picks)) == 1, picks  # the same long prompt goes where its prefix is cached
    blamed = replicas[picks[0]]
    assert blamed.consecutive_failures == EJECT_AFTER_5XX and not blamed.is_available(now())
    assert all(r.is_available(now()) for r in replicas.values() if r is not blamed)
