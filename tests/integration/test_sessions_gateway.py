"""Agent sessions through real gateways, with the OpenAI SDK as the agent: tool loops with and without session headers
(streamed and plain answers) are one session each, found by header, by the tool-call ids m3gate returned, or by
history; the tool turnaround m3gate measures matches the agent's own tool time; and two gateways sharing Redis see a
session whose turns alternate between them as one, with the right turnaround."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.lib.private_redis import PrivateRedis
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
TOOL_S = 0.25  # how long the agent's "tool" runs between an answer and the next request


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant", "--mean-output-tokens", "8"]}
                       for _ in range(2)]) as procs:
        yield procs


def _config(sims: list[SimProcess], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "pools": [{"name": "interactive", "max_model_len": 8192,
                                       "endpoints": [s.url for s in sims]}],
            "server": {"health_interval_s": 0.5}, **extra}


@pytest.fixture(scope="module")
def gateway(sims: list[SimProcess]) -> Iterator[GatewayProcess]:
    gw = start_gateway(_config(sims))
    try:
        yield gw
    finally:
        gw.stop()


def _client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=30)


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, tools: bool,
         headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One turn; returns the assistant message as the agent appends it to its history."""
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 200, "extra_headers": headers or {}}
    if tools:
        kwargs.update(tools=TOOLS, tool_choice="required")
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        return {"role": "assistant", "content": message.content or "", **({"tool_calls": calls} if calls else {})}
    content, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["id"] = call.id or entry["id"]
            if call.function is not None:
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def _agent(gateways: list[GatewayProcess], *, stream: bool, tool_turns: int, headers: dict[str, str] | None = None,
           user_turns: int = 1) -> list[dict[str, Any]]:
    """A coding agent: a user task, tool calls answered after TOOL_S each, then a final answer; then more user
    turns. Turns go round-robin over `gateways` (a load balancer)."""
    clients = [_client(gw) for gw in gateways]
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {time.monotonic_ns()}."},
                                      {"role": "user", "content": "Fix the failing test."}]
    turn = 0
    for _ in range(user_turns):
        for _ in range(tool_turns):
            answer = _ask(clients[turn % len(clients)], messages, stream, tools=True, headers=headers)
            turn += 1
            assert answer.get("tool_calls"), "tool_choice=required: the replica asks for a tool"
            messages.append(answer)
            time.sleep(TOOL_S)  # the tool runs
            for call in answer["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "file contents ..."})
        messages.append(_ask(clients[turn % len(clients)], messages, stream, tools=False, headers=headers))
        turn += 1
        messages.append({"role": "user", "content": "Thanks. Now add a test."})
    return messages


def _sessions(gw: GatewayProcess) -> dict[str, Any]:
    r = httpx.get(gw.url + "/admin/sessions", params={"limit": 1000}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _newest(gw: GatewayProcess) -> dict[str, Any]:
    return max(_sessions(gw)["open"], key=lambda s: s["started"])


def _metrics(gw: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_a_tool_loop_without_session_headers_is_one_session_found_by_tool_call_ids(
    gateway: GatewayProcess, stream: bool
) -> None:
    _agent([gateway], stream=stream, tool_turns=3)
    session = _newest(gateway)
    assert session["turns"] == 4 and session["tool_waits"] == 3
    assert session["id_source"] == "none"  # the first turn named nothing; the later ones were found
    kinds = [t["kind"] for t in session["recent_turns"]]
    assert kinds == ["first", "tool_result", "tool_result", "tool_result"]
    waits = [t["wait_s"] for t in session["recent_turns"] if t["wait"] == "tool"]
    assert len(waits) == 3 and all(TOOL_S <= w <= TOOL_S + 0.15 for w in waits), waits
    assert session["tool_s"] == pytest.approx(sum(waits), abs=0.01)


def test_user_turns_are_found_by_history_and_timed_as_think_time(gateway: GatewayProcess) -> None:
    before = _metrics(gateway)
    _agent([gateway], stream=True, tool_turns=0, user_turns=3)  # no tools: only the history links the turns
    session = _newest(gateway)
    assert session["turns"] == 3 and session["think_waits"] == 2 and session["tool_waits"] == 0
    after = _metrics(gateway)
    key = ("m3gate_turns_total", (("cache_path", "cold"), ("class", "interactive"), ("id_source", "history"),
                                  ("pool", "interactive"), ("turn_kind", "user")))
    warm = ("m3gate_turns_total", (("cache_path", "warm"), ("class", "interactive"), ("id_source", "history"),
                                   ("pool", "interactive"), ("turn_kind", "user")))
    assert after.get(key, 0) + after.get(warm, 0) - before.get(key, 0) - before.get(warm, 0) == 2
    think = ("m3gate_user_think_seconds_count", (("class", "interactive"), ("pool", "interactive")))
    assert after[think] - before.get(think, 0) == 2


def test_a_session_header_wins_and_ids_never_reach_labels(gateway: GatewayProcess) -> None:
    secret = "user-alice@example.com-7f3a"
    _agent([gateway], stream=True, tool_turns=2, headers={"x-claude-code-session-id": secret})
    sessions = _sessions(gateway)
    assert secret not in json.dumps(sessions)  # hashed in the admin view
    newest = max(sessions["open"], key=lambda s: s["started"])
    assert newest["id_source"] == "header" and newest["turns"] == 3 and newest["tool_waits"] == 2
    assert secret not in httpx.get(gateway.url + "/metrics", timeout=10).text
    header = ("m3gate_turns_total", (("cache_path", "cold"), ("class", "interactive"), ("id_source", "header"),
                                     ("pool", "interactive"), ("turn_kind", "tool_result")))
    metrics = _metrics(gateway)
    warm = (header[0], tuple(("cache_path", "warm") if k == "cache_path" else (k, v) for k, v in header[1]))
    assert metrics.get(header, 0) + metrics.get(warm, 0) >= 2


def test_turns_alternating_between_two_gateways_are_one_session(
    sims: list[SimProcess], private_redis: PrivateRedis
) -> None:
    config = _config(sims, state=f"redis://127.0.0.1:{private_redis.port}/7")
    gateways = [start_gateway(config), start_gateway(config)]
    try:
        time.sleep(0.3)
        _agent(gateways, stream=True, tool_turns=3)  # turns 1 and 3 on A, 2 and 4 on B: no session header
        time.sleep(0.3)  # the last answer's record reaches the other gateway (one 25 ms flush)
        for gw in gateways:
            session = _newest(gw)
            assert session["turns"] == 4 and session["tool_waits"] == 3, session
            assert TOOL_S * 3 <= session["tool_s"] <= TOOL_S * 3 + 0.3, session
    finally:
        for gw in gateways:
            gw.stop()
