"""The background lane's pause on REAL vLLM: one CPU server serving the tiny model, two sequences at once
(`--max-num-seqs 2`), every engine step 50 ms longer (tests/e2e/vllm_plugins/slow_steps.py; logits untouched), behind
a gateway that reads one request waiting inside vLLM as saturation.

A greedy background stream (chat, then completions) is read through the OpenAI SDK while foreground requests
saturate the server (vLLM's own queue) and then wait in the gateway's: the gateway pauses the background stream (its
upstream request ended, vLLM aborts it), holds the client, and resumes it from its token ids when the foreground is
served. The client's answer must equal the same request run uninterrupted on the server (asked directly), with
exactly N completion tokens and no error; the pause is counted in m3gate_stream_pauses_total.

Marked `vllm_own` (its server's arguments differ from the session's): about 80-200 s to boot on two busy cores.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
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
N = 60  # tokens in each background answer: ~3 s at 50 ms a step
CASES: dict[str, dict[str, Any]] = {  # greedy answers of the tiny model that show text at every token
    "completions": {"prompt": "ka ri to me lo sa nu vi de pa"},
    "chat": {"messages": [{"role": "user", "content": "def add(x, y):"}]},
}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[VllmServer, GatewayProcess]]:
    if vllm_skipped():
        pytest.skip(f"{SKIP_ENV}=1")
    began = time.monotonic()
    servers = start_servers([MAX_MODEL_LEN], extra_args=["--logits-processors", "slow_steps:SlowSteps",
                                                          "--max-num-seqs", "2"],
                            env={"PYTHONPATH": str(Path(__file__).with_name("vllm_plugins"))})
    print(f"\nvLLM server healthy after {time.monotonic() - began:.0f} s")
    gw = start_gateway({
        "model": MODEL, "pools": [{"name": "p", "max_model_len": MAX_MODEL_LEN, "endpoints": [servers[0].url]}],
        "server": {"health_interval_s": 0.2}, "admin": {"watch_config": False},
        "traffic": {"pool_classes": {"p": "chat"}, "saturation": {"max_waiting": 1},
                    "classes": {"chat": {"priority": 0, "max_queue_wait_s": 120},
                                "batch": {"priority": 9, "background": True, "max_queue_wait_s": 120}}},
    })
    try:
        yield servers[0], gw
    finally:
        gw.stop()
        stop_all(servers)


def pauses(gw: GatewayProcess) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    found = re.findall(r'^m3gate_stream_pauses_total\{class="batch",pool="p"\}\s+([0-9.e+-]+)$', text, re.M)
    return float(found[0]) if found else 0.0


def saturated(gw: GatewayProcess) -> bool:
    return bool(httpx.get(gw.url + "/admin/traffic", timeout=5).json()["pools"].get("p", {}).get("saturated"))


def foreground(client: openai.OpenAI, out: list[str]) -> None:
    answer = client.completions.create(model=MODEL, prompt="hello there", max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    out.append(answer.choices[0].text)


@pytest.mark.parametrize("api", list(CASES))
def test_a_paused_stream_on_real_vllm_equals_its_uninterrupted_answer(
        stack: tuple[VllmServer, GatewayProcess], api: str) -> None:
    server, gw = stack
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=300)
    body = {"model": MODEL, "max_tokens": N, "temperature": 0, **CASES[api]}
    create = client.completions if api == "completions" else client.chat.completions
    before = pauses(gw)
    stream = create.create(stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                           extra_headers={"x-m3gate-class": "batch"}, **body)
    got, usage, finish, threads, done = "", None, None, [], []
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            got += choice.text if api == "completions" else (choice.delta.content or "")
            finish = choice.finish_reason or finish
        if got and not threads:  # streaming: the foreground arrives, first filling vLLM's batch and queue ...
            threads = [threading.Thread(target=foreground, args=(client, done)) for _ in range(5)]
            for t in threads[:3]:
                t.start()
            deadline = time.monotonic() + 10
            while not saturated(gw) and time.monotonic() < deadline:
                time.sleep(0.02)
            for t in threads[3:]:  # ... then waiting in the gateway's: the background stream is paused
                t.start()
    for t in threads:
        t.join(120)
    assert len(done) == 5
    assert pauses(gw) > before, "the background stream was not paused"
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    ref = httpx.post(server.url + path, json={**body, "ignore_eos": True}, timeout=300).json()
    choice = ref["choices"][0]
    expected = choice["text"] if api == "completions" else (choice["message"].get("content") or "")
    assert usage is not None and usage.completion_tokens == N == ref["usage"]["completion_tokens"]
    assert finish == "length" == choice["finish_reason"]
    assert got == expected, (got, expected)


def _comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed answer less what differs between two runs of one request: its id and time, and the usage
    details (prompt tokens cached; a resumed answer's usage is the gateway's count)."""
    out = {k: v for k, v in answer.items() if k not in ("id", "created")}
    out["usage"] = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return out


def lane_in_flight(gw: GatewayProcess) -> int:
    pool = httpx.get(gw.url + "/admin/traffic", timeout=5).json()["pools"].get("p", {})
    return int(pool.get("background", {}).get("batch", {}).get("in_flight", 0))


@pytest.mark.parametrize("api", list(CASES))
def test_a_paused_non_streamed_request_on_real_vllm_answers_as_vllm_does(
        stack: tuple[VllmServer, GatewayProcess], api: str) -> None:
    """Sent upstream as a stream so that it can be paused, put together into the object vLLM itself answers
    non-streamed: field for field the same, paused or not."""
    server, gw = stack
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    body = {"model": MODEL, "max_tokens": N, "temperature": 0, "ignore_eos": True, **CASES[api]}
    ref = _comparable(httpx.post(server.url + path, json=body, timeout=300).json())
    batch = {"x-m3gate-class": "batch"}
    assert _comparable(httpx.post(gw.url + path, json=body, headers=batch, timeout=300).json()) == ref
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=300)
    before, got = pauses(gw), []
    asked = threading.Thread(target=lambda: got.append(httpx.post(gw.url + path, json=body, headers=batch,
                                                                  timeout=300)))
    asked.start()
    deadline = time.monotonic() + 30
    while lane_in_flight(gw) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # some of its tokens are out
    threads = [threading.Thread(target=foreground, args=(client, [])) for _ in range(5)]
    for t in threads[:3]:
        t.start()
    deadline = time.monotonic() + 10
    while not saturated(gw) and time.monotonic() < deadline:
        time.sleep(0.02)
    for t in threads[3:]:
        t.start()
    for t in [*threads, asked]:
        t.join(180)
    assert pauses(gw) > before, "the non-streamed background request was not paused"
    assert got and got[0].status_code == 200 and got[0].headers["content-type"] == "application/json"
    assert _comparable(got[0].json()) == ref
