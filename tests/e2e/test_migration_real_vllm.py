"""Stream migration on REAL vLLM: three CPU servers serving the tiny model (float32) in one pool behind a gateway.

A greedy (temperature 0) `ignore_eos` stream of N tokens is read through the real OpenAI SDK; after a few tokens (the
first text chunk, a few, or the finish chunk) the server serving it is SIGKILLed. The client's stream must still end
with exactly N completion tokens, the same `prompt_tokens`, and the text of the same request run uninterrupted on a
surviving server (asked directly, with `return_token_ids`), so nothing is lost or repeated at the seam. Each test kills one server: three servers serve
the first two tests, a replacement is booted for every second one after (one server's boot: ~80 s on two busy
cores).

The module starts its own servers (they are killed, so the session's cannot be used): marked `vllm_own`, which
`make test` runs in its second pass, after the session's servers have stopped. Their boot costs about as much as
the session's (three servers at once: 195-226 s on two busy cores; the fixture prints the figures).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.vllm_local.launcher import start_servers
from pools.vllm_local.processes import VllmServer, stop_all
from tests.vllm_fixtures import SKIP_ENV, vllm_skipped

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_own, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "MiniMaxAI/MiniMax-M3"
MAX_MODEL_LEN = 2048
# Every engine step 50 ms longer (tests/e2e/vllm_plugins/slow_steps.py; logits untouched): a 60-token answer then
# takes ~3 s instead of ~0.15 s, so the kill after a few chunks lands mid-stream.
SLOW = {"extra_args": ["--logits-processors", "slow_steps:SlowSteps"],
        "env": {"PYTHONPATH": str(Path(__file__).with_name("vllm_plugins"))}}
N = 60  # tokens in each answer
KILL_AFTER = 4  # streamed chunks with text before the serving server is killed
# Requests whose greedy answers from the tiny random model show text at every token (some prompts give tokens that
# decode to nothing, where a token lost at the seam would not show in the text): " pa pa … call call …",
# "\n\n chorus chorus …", and with thinking enabled reasoning "<mm:think><mm:think>…" (the marker as reasoning text).
CASES: dict[str, dict[str, Any]] = {
    "completions": {"prompt": "ka ri to me lo sa nu vi de pa"},
    "chat": {"messages": [{"role": "user", "content": "def add(x, y):"}]},
    "chat-thinking": {"messages": [{"role": "user", "content": "Once upon a time"}],
                      "chat_template_kwargs": {"thinking_mode": "enabled"}},
}


@dataclass
class Cluster:
    servers: list[VllmServer]
    gateway: GatewayProcess
    killed: list[str] = field(default_factory=list)

    def alive(self) -> list[VllmServer]:
        return [s for s in self.servers if s.url not in self.killed]

    def kill(self, url: str) -> None:
        next(s for s in self.servers if s.url == url).kill()
        self.killed.append(url)

    def ready(self) -> None:
        """Two live servers in the pool (one to kill, one to resume on), the killed ones out of the gateway's way."""
        if len(self.alive()) < 2:  # a third kill: one more server (a whole boot; printed)
            began = time.monotonic()
            self.servers += start_servers([MAX_MODEL_LEN], **SLOW)
            print(f"\na replacement vLLM server healthy after {time.monotonic() - began:.0f} s")
            self.gateway.write_config(gateway_config([s.url for s in self.alive()]))
            httpx.post(self.gateway.url + "/admin/reload", timeout=30).raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            replicas = httpx.get(self.gateway.url + "/admin/pools", timeout=5).json()["pools"]["interactive"][
                "replicas"]
            if not any(replicas.get(url, {}).get("available") for url in self.killed) and all(
                    replicas.get(s.url, {}).get("available") for s in self.alive()):
                return
            time.sleep(0.2)
        raise AssertionError(f"the gateway's replicas are not as expected: {replicas}")


def gateway_config(urls: list[str]) -> dict[str, Any]:
    return {"model": MODEL, "pools": [{"name": "interactive", "max_model_len": MAX_MODEL_LEN, "endpoints": urls}],
            "server": {"health_interval_s": 0.5}, "admin": {"watch_config": False}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if vllm_skipped():
        pytest.skip(f"{SKIP_ENV}=1")
    began = time.monotonic()
    servers = start_servers([MAX_MODEL_LEN] * 3, **SLOW)
    print(f"\nthree vLLM servers healthy after {time.monotonic() - began:.0f} s")
    made = Cluster(servers, start_gateway(gateway_config([s.url for s in servers])))
    try:
        yield made
    finally:
        made.gateway.stop()
        stop_all(made.servers)


def migrations(gw: GatewayProcess, outcome: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    pattern = rf'^m3gate_stream_migrations_total\{{[^}}]*outcome="{outcome}"[^}}]*\}}\s+([0-9.e+-]+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


@dataclass
class Streamed:
    """What one client saw of a stream."""

    endpoint: str
    ids: set[str] = field(default_factory=set)
    reasoning: str = ""
    content: str = ""
    text: str = ""
    finish: str | None = None
    usage: Any = None
    cut_at: str = ""  # the text the client had when the server was killed


def read_stream(cluster: Cluster, raw: Any, api: str, kill_after: int | None) -> Streamed:
    """Reads the stream; SIGKILLs the server serving it after `kill_after` chunks with text, or (None) once the
    finish chunk came (its usage chunk and [DONE] may not have)."""
    out = Streamed(endpoint=raw.headers.get("x-m3gate-endpoint", ""))
    assert out.endpoint in {s.url for s in cluster.alive()}, out.endpoint
    with_text = 0
    for chunk in raw.parse():
        out.ids.add(chunk.id)
        if chunk.usage is not None:
            out.usage = chunk.usage
        for choice in chunk.choices:
            if api != "completions":
                piece_r = getattr(choice.delta, "reasoning", None) or ""
                piece_c = choice.delta.content or ""
                out.reasoning += piece_r
                out.content += piece_c
                piece = piece_r + piece_c
            else:
                piece = choice.text or ""
                out.text += piece
            out.finish = choice.finish_reason or out.finish
            with_text += bool(piece)
        if (with_text == kill_after or (kill_after is None and out.finish)) and not out.cut_at:
            out.cut_at = out.reasoning + out.content + out.text
            cluster.kill(out.endpoint)
    return out


def uninterrupted(server: VllmServer, api: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request on one surviving server, directly, not streamed, with its token ids."""
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    resp = httpx.post(server.url + path, json={**body, "stream": False, "return_token_ids": True}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize(("api", "kill_after"), [
    *((api, KILL_AFTER) for api in CASES),
    ("chat", 1),  # the first text chunk: greedy, the chat request again with that text suppressed
    ("completions", None),  # after the finish chunk: only the usage chunk and [DONE] are the gateway's to write
])
def test_killed_server_stream_continues_token_exact(cluster: Cluster, api: str, kill_after: int | None) -> None:
    cluster.ready()
    client = openai.OpenAI(base_url=cluster.gateway.base_url, api_key="unused", max_retries=0, timeout=300)
    body = {"model": MODEL, "max_tokens": N, "temperature": 0, "ignore_eos": True, **CASES[api]}
    resumed_before = migrations(cluster.gateway, "resumed")
    extra = {k: v for k, v in body.items() if k in ("ignore_eos", "chat_template_kwargs")}
    sdk = {k: v for k, v in body.items() if k not in extra}
    create = client.completions if api == "completions" else client.chat.completions
    raw = create.with_raw_response.create(stream=True, stream_options={"include_usage": True}, extra_body=extra,
                                          **sdk)
    got = read_stream(cluster, raw, api, kill_after)
    assert got.endpoint in cluster.killed, "the serving server was not killed mid-stream"
    resumed = 0 if kill_after is None else 1  # an answer complete but for its end is not resumed
    assert migrations(cluster.gateway, "resumed") == resumed_before + resumed, "resumed a wrong number of times"
    ref = uninterrupted(cluster.alive()[0], api, body)
    choice = ref["choices"][0]
    assert len(choice["token_ids"]) == N and ref["usage"]["completion_tokens"] == N, ref["usage"]
    print(f"\n{api}: killed {got.endpoint} after {got.cut_at!r}; reference ids {choice['token_ids']}")
    assert got.usage is not None, "no usage chunk"
    assert got.usage.completion_tokens == N, got.usage
    assert got.usage.prompt_tokens == ref["usage"]["prompt_tokens"], (got.usage, ref["usage"])
    assert got.finish == "length" == choice["finish_reason"]
    assert len(got.ids) == 1, f"one stream id expected: {got.ids}"
    if api == "completions":
        assert got.text == choice["text"], (got.text, choice["text"])
        whole = got.text
    else:
        message = choice["message"]
        assert got.reasoning == (message.get("reasoning") or ""), (got.reasoning, message)
        assert got.content == (message.get("content") or ""), (got.content, message)
        whole = got.reasoning + got.content
    assert got.cut_at and whole.startswith(got.cut_at), (got.cut_at, whole)
    assert len(whole) > len(got.cut_at) or kill_after is None, (got.cut_at, whole)
