"""The background lane through a real gateway in front of one simulated replica that runs at most four sequences at
once (more wait inside it: `vllm:num_requests_waiting`, which the gateway reads as saturation at 1): a background
class fills the spare capacity of an idle pool (its window grows from one as its requests succeed, never more of
them in flight than the window), and a foreground burst that saturates the replica makes the lane give way (pauses
or a cut window) while the foreground is served; background streams running when foreground requests wait on the saturated pool are paused
(their upstream request ended, the client held) and resumed exactly: each greedy answer (chat, chat with reasoning,
completions) equals its uninterrupted one, with no error, repeated or lost token."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
BATCH = {"x-m3gate-class": "batch"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--max-num-seqs", "4"]}]) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": "p", "max_model_len": 8192, "endpoints": [sims[0].url]}],
            "server": {"health_interval_s": 0.1},
            "traffic": {
                "pool_classes": {"p": "chat"},
                "saturation": {"max_waiting": 1},
                "classes": {
                    "chat": {"priority": 0, "max_concurrency": 32, "queue_length": 64, "max_queue_wait_s": 60,
                             "ttft_target_s": 30},
                    "batch": {"priority": 9, "background": True, "max_concurrency": 8, "queue_length": 64,
                              "max_queue_wait_s": 60, "max_pauses": 2, "pause_keepalive_s": 0.05},
                },
            },
        })
        try:
            yield gw
        finally:
            gw.stop()


def _pool(gw: GatewayProcess) -> dict[str, Any]:
    return httpx.get(gw.url + "/admin/traffic", timeout=5).json()["pools"].get("p", {})


def _lane(gw: GatewayProcess) -> dict[str, Any]:
    return _pool(gw).get("background", {}).get("batch", {})


def _stream(client: openai.OpenAI, tokens: int, headers: dict[str, str] | None = None) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}},
        extra_headers=headers)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _in_threads(n: int, fn: Callable[[], str]) -> tuple[list[threading.Thread], list[str]]:
    out: list[str] = []

    def run() -> None:
        out.append(fn())

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, out


def _watch(gw: GatewayProcess, threads: list[threading.Thread], seen: list[dict[str, Any]]) -> None:
    while any(t.is_alive() for t in threads):
        lane = _lane(gw)
        if lane:
            seen.append(lane)
        time.sleep(0.02)


def test_background_fills_spare_capacity_within_its_window(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=60)
    threads, answers = _in_threads(10, lambda: _stream(client, 24, BATCH))
    seen: list[dict[str, Any]] = []
    _watch(gateway, threads, seen)
    assert len(answers) == 10 and all(answers)
    # the window starts at one and grows by one per increase (a cut lets running requests end): never more in flight
    assert all(sample["in_flight"] <= 1 + sample["increases"] for sample in seen)
    assert max(s["window"] for s in seen) >= 3  # it grew from one on an idle pool: the spare capacity is used
    lane = _lane(gateway)
    assert lane["increases"] >= 2
    metrics = httpx.get(gateway.url + "/metrics", timeout=5).text
    assert f'm3gate_background_window{{class="batch",pool="p"}} {float(lane["window"])}' in metrics
    pools = httpx.get(gateway.url + "/ui/state", timeout=5).json()["pools"]  # the status page's data
    assert [p["background"] for p in pools if p["name"] == "p"] == [
        [{"class": "batch", "window": lane["window"], "in_flight": 0, "paused": 0}]]


def _pauses(gw: GatewayProcess) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('m3gate_stream_pauses_total{class="batch",pool="p"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_foreground_burst_makes_the_lane_give_way_and_is_served(gateway: GatewayProcess) -> None:
    """The burst saturates the replica: the lane either pauses its streams there (once the gateway has seen how
    many the replica runs at once, each foreground request sent to it full pauses one) or, while they still run
    beside a saturated replica, has its window cut; both, often."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=60)
    warm, _ = _in_threads(6, lambda: _stream(client, 16, BATCH))  # grow the window first
    for t in warm:
        t.join(60)
    before = _lane(gateway)
    paused_before = _pauses(gateway)
    assert before["window"] >= 2  # AIMD: it may have been cut since, never below what a halving can show
    background, bg_answers = _in_threads(4, lambda: _stream(client, 200, BATCH))
    deadline = time.monotonic() + 10
    while _lane(gateway)["in_flight"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    burst, answers = _in_threads(8, lambda: _stream(client, 48))  # more than the replica runs at once: it saturates
    deadline = time.monotonic() + 20
    highest = before["window"]  # a cut window regains its size between bursts (BackgroundWindow.recover)
    cut = paused = False
    while not (cut or paused) and time.monotonic() < deadline:
        lane = _lane(gateway)
        highest = max(highest, lane["window"])
        cut = lane["decreases"] > before["decreases"] and lane["window"] < highest
        paused = _pauses(gateway) > paused_before
        time.sleep(0.02)
    assert cut or paused
    for t in burst + background:
        t.join(60)
    assert len(answers) == 8 and all(answers)  # the foreground was served
    assert len(bg_answers) == 4 and all(bg_answers)  # and the background finished, late


PAUSED_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "a long answer, please"}],
                                   "chat_template_kwargs": {"thinking_mode": "disabled"}}),
    "chat_reasoning": ("/chat/completions", {"messages": [{"role": "user", "content": "think, then answer"}],
                                             "chat_template_kwargs": {"thinking_mode": "enabled"}}),
    "completions": ("/completions", {"prompt": "Once upon a time"}),
}


PAUSED_TOKENS = 240  # ~3 s a stream: still running when the foreground burst saturates, on a busy machine too


def _greedy(gw: GatewayProcess, case: str, headers: dict[str, str]) -> dict[str, Any]:
    """One greedy background stream, put together from its raw events."""
    path, body = PAUSED_CASES[case]
    wire = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": PAUSED_TOKENS, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", gw.base_url + path, json=wire, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        raw = resp.read().decode()
    out: dict[str, Any] = {"reasoning": "", "content": "", "text": "", "ids": set(), "finishes": [], "usage": None,
                           "errors": 0, "done": 0}
    keepalives = 0  # SSE comments written while paused: not part of the answer
    for event in raw.split("\n\n"):
        if not event.strip():
            continue
        if event == ": paused":
            keepalives += 1
            continue
        data = event.removeprefix("data: ")
        if data == "[DONE]":
            out["done"] += 1
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            out["errors"] += 1
            continue
        out["ids"].add(chunk["id"])
        usage = chunk.get("usage")
        if usage:  # a resumed stream's usage is counted by the gateway (no cache or reasoning details)
            out["usage"] = (usage["prompt_tokens"], usage["completion_tokens"])
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += delta.get("content") or ""
            out["text"] += choice.get("text") or ""
            if choice.get("finish_reason"):
                out["finishes"].append(choice["finish_reason"])
    out["ids"] = len(out["ids"])
    KEEPALIVES[case] = KEEPALIVES.get(case, 0) + keepalives
    return out


KEEPALIVES: dict[str, int] = {}  # per case, the keep-alive comments its streams got (pause_keepalive_s: 0.05)


def _pauses(gw: GatewayProcess) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('m3gate_stream_pauses_total{class="batch",pool="p"}'):
            return float(line.split()[-1])
    return 0.0


def _background_beside_a_burst(gateway: GatewayProcess, runs: dict[str, Callable[[], dict[str, Any]]]) -> tuple[
        dict[str, dict[str, Any]], list[str], list[str]]:
    """Each of `runs` (at most three background requests) in flight at once, then a foreground burst that saturates
    the replica (vLLM's queue) and six more requests that wait in the gateway's: the background ones are paused.
    Returns their answers and the two foreground groups' texts."""
    while _lane(gateway)["window"] < 3:  # room for the three at once
        warm, _ = _in_threads(4, lambda: _stream(openai.OpenAI(base_url=gateway.base_url, api_key="none"), 4, BATCH))
        for t in warm:
            t.join(30)
    out: dict[str, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda c=case, run=run: out.__setitem__(c, run())) for case, run in runs.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while _lane(gateway)["in_flight"] < len(runs) and time.monotonic() < deadline:
        time.sleep(0.01)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=60)
    burst, answers = _in_threads(8, lambda: _stream(client, 24))  # the replica saturates (vLLM's queue) ...
    deadline = time.monotonic() + 10
    while not _pool(gateway).get("saturated") and time.monotonic() < deadline:
        time.sleep(0.01)
    more, more_answers = _in_threads(6, lambda: _stream(client, 24))  # ... and these wait in the gateway's
    for t in burst + more + threads:
        t.join(60)
    return out, answers, more_answers


def test_a_paused_background_stream_equals_its_uninterrupted_answer(gateway: GatewayProcess) -> None:
    before = _pauses(gateway)
    alone = {case: _greedy(gateway, case, BATCH) for case in PAUSED_CASES}  # an idle pool: nothing pauses them
    assert _pauses(gateway) == before
    for answer in alone.values():
        assert answer["errors"] == 0 and answer["done"] == 1 and answer["finishes"] == ["length"]
        assert answer["usage"][1] == PAUSED_TOKENS
    assert alone["chat_reasoning"]["reasoning"] and alone["chat"]["content"] and alone["completions"]["text"]
    out, answers, more_answers = _background_beside_a_burst(gateway, {case: lambda c=case: _greedy(
        gateway, c, BATCH) for case in PAUSED_CASES})
    assert len(answers) == 8 and all(answers) and len(more_answers) == 6 and all(more_answers)
    paused = _pauses(gateway)
    assert 1 <= paused - before <= 2 * len(PAUSED_CASES)  # paused, at most max_pauses times each
    assert httpx.get(gateway.url + "/admin/traffic", timeout=5).json()["counters"]["paused"] == paused
    assert out == alone  # token for token: nothing repeated, lost or altered, no error, one id, one [DONE]
    assert sum(KEEPALIVES.values()) >= 1  # a paused stream's client got bytes while it waited


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
UNSTREAMED_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **PAUSED_CASES,
    "chat_tool": ("/chat/completions", {"messages": [{"role": "user", "content": "read the file"}], "tools": TOOLS,
                                        "tool_choice": "required"}),
}


def _unstreamed(url: str, case: str, headers: dict[str, str] | None = None, tokens: int = 100) -> dict[str, Any]:
    """One greedy non-streamed answer, less what differs between two runs of one request (its id and time, a tool
    call's id, the usage details: the prompt tokens the replica had cached)."""
    path, body = UNSTREAMED_CASES[case]
    wire = {"model": MODEL, "temperature": 0, "max_tokens": tokens, "ignore_eos": case != "chat_tool", **body}
    resp = httpx.post(url + path, json=wire, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    answer = resp.json()
    answer.pop("id"), answer.pop("created")
    # the counts; a resumed answer's usage is the gateway's count, without the replica's details (docs/scheduling.md)
    answer["usage"] = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    for call in answer["choices"][0].get("message", {}).get("tool_calls") or ():
        assert call.pop("id").startswith("chatcmpl-tool-")
    return answer


def test_a_non_streamed_background_request_answers_as_the_replica_would(gateway: GatewayProcess) -> None:
    """Sent upstream as a stream (so that it can be paused), put together into vLLM's non-streamed answer: the same
    object as the replica's own non-streamed answer, field for field."""
    replica = next(iter(httpx.get(gateway.url + "/admin/pools", timeout=5).json()["pools"]["p"]["replicas"]))
    for case in UNSTREAMED_CASES:
        assert _unstreamed(gateway.base_url, case, BATCH) == _unstreamed(replica + "/v1", case), case


def test_a_paused_non_streamed_background_request_equals_its_uninterrupted_answer(gateway: GatewayProcess) -> None:
    before = _pauses(gateway)
    cases = [c for c in UNSTREAMED_CASES if c != "chat_tool"]  # the tool call ends too soon to be paused
    alone = {case: _unstreamed(gateway.base_url, case, BATCH, PAUSED_TOKENS) for case in cases}
    assert _pauses(gateway) == before
    out, answers, more_answers = _background_beside_a_burst(gateway, {case: lambda c=case: _unstreamed(
        gateway.base_url, c, BATCH, PAUSED_TOKENS) for case in cases})
    assert len(answers) == 8 and all(answers) and len(more_answers) == 6 and all(more_answers)
    assert 1 <= _pauses(gateway) - before <= 2 * len(cases)
    for case in cases:  # the held partial answer went on exactly: one object, nothing repeated or lost
        assert json.dumps(out[case], sort_keys=True) == json.dumps(alone[case], sort_keys=True), case
