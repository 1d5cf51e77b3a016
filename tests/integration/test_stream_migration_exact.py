"""Resumed streams are exact wherever the cut falls: a short greedy stream is cut after each of its upstream events in
turn (1 to the last: the role chunk, every token, held-back ones included, the finish chunk, the usage chunk, before
[DONE]), and a stream is cut twice (A, then B, C clean). Every answer must equal the uninterrupted one: text,
reasoning, tool calls, exactly one finish_reason, the usage, one `id`, one [DONE], no error event.

The first leg is cut by the simulator's `x-sim-drop-after-chunks` request header (the gateway forwards the client's
headers to the first attempt only); a continuation is cut by the `/sim/faults` of the replica it goes to. The
gateway routes round robin, so where each leg goes is known, and no replica is cut often enough in a row to be
ejected. Simulators are started once for the module (`--instant`: the whole loop takes seconds)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]
USAGE = {"stream_options": {"include_usage": True}}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_reasoning": ("/chat/completions", {
        "messages": [{"role": "user", "content": "think hard, then answer"}], "max_tokens": 10, "ignore_eos": True,
        "chat_template_kwargs": {"thinking_mode": "enabled"}, **USAGE}),
    "chat_adaptive": ("/chat/completions", {  # adaptive thinking: the answer opens its reasoning with <mm:think>
        "messages": [{"role": "user", "content": "think about it"}], "max_tokens": 8, "ignore_eos": True,
        **USAGE}),
    "chat_tool": ("/chat/completions", {
        "messages": [{"role": "user", "content": "weather in Rome, now"}], "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 200, "chat_template_kwargs": {"thinking_mode": "disabled"}, **USAGE}),
    "chat_reasoning_tool": ("/chat/completions", {
        "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 200, "chat_template_kwargs": {"thinking_mode": "enabled"}, **USAGE}),
    "completions": ("/completions", {"prompt": "Write a story about ships.", "max_tokens": 10, "ignore_eos": True}),
    "completions_usage": ("/completions", {"prompt": "Ships again.", "max_tokens": 6, "ignore_eos": True, **USAGE}),
}


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[list[SimProcess], GatewayProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant"]} for _ in range(3)]) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [s.url for s in sims]}],
            "server": {"health_interval_s": 0.5},
            "routing": {"policy": "round_robin", "migration": {"stall_timeout_s": 5, "max_migrations": 3}},
        })
        try:
            yield sims, gw
        finally:
            gw.stop()


def post(gw: GatewayProcess, path: str, body: dict[str, Any], cut: int | None = None) -> tuple[str, dict[str, Any]]:
    """One streamed answer through the gateway, put together from its raw events: (endpoint, answer)."""
    headers = {} if cut is None else {"x-sim-drop-after-chunks": str(cut)}
    with httpx.stream("POST", gw.base_url + path, json={"model": MODEL, "stream": True, "temperature": 0, **body},
                      headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        raw = resp.read()
        endpoint = resp.headers["x-m3gate-endpoint"]
    return endpoint, assemble(raw)


def assemble(raw: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {"reasoning": "", "content": "", "text": "", "calls": {}, "ids": set(), "finishes": [],
                           "usage": None, "done": 0, "errors": 0, "after_done": 0}
    for line in raw.decode().split("\n\n"):
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        data = line[6:]
        if out["done"]:
            out["after_done"] += 1
        if data == "[DONE]":
            out["done"] += 1
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            out["errors"] += 1
            continue
        out["ids"].add(chunk["id"])
        if chunk.get("usage"):
            out["usage"] = (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"])
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += delta.get("content") or ""
            out["text"] += choice.get("text") or ""
            for call in delta.get("tool_calls") or ():
                entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": "", "announced": 0})
                function = call.get("function") or {}
                if function.get("name"):
                    entry["name"] += function["name"]
                    entry["announced"] += 1
                entry["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason") is not None:
                out["finishes"].append(choice["finish_reason"])
    return out


def comparable(answer: dict[str, Any]) -> tuple[Any, ...]:
    calls = [(c["name"], json.loads(c["arguments"]), c["announced"]) for _, c in sorted(answer["calls"].items())]
    return (answer["reasoning"], answer["content"], answer["text"], calls, answer["finishes"], answer["usage"],
            len(answer["ids"]), answer["done"], answer["errors"], answer["after_done"])


def upstream_events(sim: SimProcess, path: str, body: dict[str, Any]) -> int:
    """How many events the replica sends for this request as the gateway asks for it (token ids, usage)."""
    wire = {"model": MODEL, "stream": True, "temperature": 0, **body, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    raw = httpx.post(sim.url + "/v1" + path, json=wire, timeout=30).content
    return raw.count(b"\n\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stream_cut_after_any_event_completes_as_the_uninterrupted_answer(
        setup: tuple[list[SimProcess], GatewayProcess], case: str) -> None:
    sims, gw = setup
    path, body = CASES[case]
    _, whole = post(gw, path, body)
    assert len(whole["finishes"]) == 1 and whole["done"] == 1 and whole["errors"] == 0
    assert whole["reasoning"] or whole["content"] or whole["text"] or whole["calls"]
    events = upstream_events(sims[0], path, body)
    wrong = {}
    for cut in range(1, events):  # after 0 events nothing came: a retry elsewhere (which the header would cut too)
        _, resumed = post(gw, path, body, cut=cut)
        if comparable(resumed) != comparable(whole):
            wrong[cut] = comparable(resumed)
    assert not wrong, f"{events} events; uninterrupted: {comparable(whole)}; cut after k events: {wrong}"


@pytest.mark.parametrize(("case", "first", "second"), [
    ("chat_reasoning", 4, 3),  # a token-id continuation cut mid-way
    ("chat_reasoning", 2, 4),  # one text chunk shown: the chat request again (its replay suppressed), cut after it
    ("chat_reasoning", 2, 2),  # ... cut while it still replays what the client saw
    ("chat_tool", 3, 5),
    ("completions", 3, 4),
])
def test_a_stream_cut_twice_completes_as_the_uninterrupted_answer(
        setup: tuple[list[SimProcess], GatewayProcess], case: str, first: int, second: int) -> None:
    sims, gw = setup
    path, body = CASES[case]
    by_url = sorted(sims, key=lambda s: s.url)
    probe, whole = post(gw, path, body)  # round robin: the next three legs go to the next three replicas in turn
    at = [s.url for s in by_url].index(probe)
    a, b, c = (by_url[(at + i) % 3] for i in (1, 2, 3))
    before = resumed_count(gw)
    b.set_faults(drop_mid_stream=1.0, drop_after_chunks=second)
    try:
        endpoint, resumed = post(gw, path, body, cut=first)
    finally:
        b.set_faults(drop_mid_stream=0.0, drop_after_chunks=None)
    assert endpoint == a.url
    assert comparable(resumed) == comparable(whole)
    assert resumed_count(gw) == before + 2  # on B, then on C
    assert c.stats()["completed"] >= 1


def resumed_count(gw: GatewayProcess) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'm3gate_stream_migrations_total{outcome="failed"' not in text
    found = re.search(r'm3gate_stream_migrations_total\{outcome="resumed",pool="interactive"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0
