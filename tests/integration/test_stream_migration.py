"""Stream migration end to end: simulated replicas in greedy mode behind a real gateway, the OpenAI SDK as the client.
The replica serving a stream is SIGKILLed (or SIGTERMed) at a random chunk; the client's stream must come out equal
to the uninterrupted answer of the same request: text, reasoning, tool call, finish_reason, usage, one id."""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]
USAGE = {"stream_options": {"include_usage": True}}
CASES = {
    "chat_reasoning": {"messages": [{"role": "user", "content": "think hard, then answer"}], "max_tokens": 70,
                       "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "enabled"}}},
    "chat_tool": {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS,
                  "tool_choice": "required", "max_tokens": 400,
                  "extra_body": {"chat_template_kwargs": {"thinking_mode": "enabled"}}},
    "chat_tool_only": {"messages": [{"role": "user", "content": "weather in Rome, now"}], "tools": TOOLS,
                       "tool_choice": "required", "max_tokens": 400,
                       "extra_body": {"chat_template_kwargs": {"thinking_mode": "disabled"}}},
    "chat_plain": {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 60,
                   "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}}},
}


def gateway_for(sims: list[SimProcess], **migration: Any) -> GatewayProcess:
    return start_gateway({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [s.url for s in sims]}],
        "server": {"health_interval_s": 0.3},
        "routing": {"policy": "least_loaded", "migration": {"stall_timeout_s": 1.5, **migration}},
    })


@pytest.fixture
def pair() -> Iterator[tuple[list[SimProcess], GatewayProcess]]:
    with running_sims([{"max_model_len": 8192} for _ in range(2)]) as sims:
        gw = gateway_for(sims)
        try:
            yield sims, gw
        finally:
            gw.stop()


def client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=60)


def chat(gw: GatewayProcess, body: dict[str, Any], cut: int | None = None, sims: list[SimProcess] = (),
         how: signal.Signals = signal.SIGKILL) -> dict[str, Any]:
    """One streamed chat answer, put together; with `cut`, its replica gets `how` once that many chunks came."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "ids": set(), "finish": None, "usage": None}
    with client(gw).chat.completions.with_streaming_response.create(
            model=MODEL, stream=True, temperature=0, **USAGE, **body) as resp:
        endpoint = resp.headers["x-m3gate-endpoint"]
        for i, chunk in enumerate(resp.parse()):
            if i == cut:
                signal_replica(sims, endpoint, how)
            out["ids"].add(chunk.id)
            if chunk.usage is not None:
                out["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                delta = choice.delta
                out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
                out["content"] += delta.content or ""
                for call in delta.tool_calls or ():
                    entry = out["calls"].setdefault(call.index, {"name": "", "arguments": "", "ids": 0})
                    if call.function and call.function.name:
                        entry["name"] += call.function.name
                        entry["ids"] += 1
                    if call.function and call.function.arguments:
                        entry["arguments"] += call.function.arguments
                out["finish"] = choice.finish_reason or out["finish"]
    out["endpoint"] = endpoint
    return out


def signal_replica(sims: list[SimProcess], endpoint: str, how: signal.Signals) -> None:
    sim = next(s for s in sims if s.url == endpoint)
    sim._proc.send_signal(how)  # type: ignore[union-attr]


def migrations(gw: GatewayProcess) -> dict[str, float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'm3gate_stream_migrations_total\{outcome="(\w+)",pool="interactive"\} (\S+)', text)}


def comparable(answer: dict[str, Any]) -> tuple[Any, ...]:
    calls = [(c["name"], json.loads(c["arguments"]), c["ids"]) for _, c in sorted(answer["calls"].items())]
    return answer["reasoning"], answer["content"], calls, answer["finish"], answer["usage"], len(answer["ids"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_chat_stream_cut_at_a_random_token_completes_as_the_uninterrupted_answer(
        pair: tuple[list[SimProcess], GatewayProcess], case: str) -> None:
    sims, gw = pair
    body = CASES[case]
    whole = chat(gw, body)
    assert whole["finish"] in ("length", "tool_calls") and len(whole["ids"]) == 1
    # a tool call alone shows the client three chunks (role, the call's name, its arguments): cut after the name
    cut = 1 if case == "chat_tool_only" else random.Random(case).randint(2, 12)
    resumed = chat(gw, body, cut=cut, sims=sims)
    assert comparable(resumed) == comparable(whole), f"cut after {cut} chunks"
    assert migrations(gw).get("resumed", 0) >= 1


def test_a_completion_cut_at_a_random_token_completes_exactly(pair: tuple[list[SimProcess], GatewayProcess]) -> None:
    sims, gw = pair

    def run(cut: int | None) -> tuple[str, str | None, tuple[int, int] | None, set[str]]:
        text, finish, usage, ids = "", None, None, set()
        with client(gw).completions.with_streaming_response.create(
                model=MODEL, prompt="Write a story about ships.", max_tokens=80, temperature=0, stream=True,
                **USAGE) as resp:
            endpoint = resp.headers["x-m3gate-endpoint"]
            for i, chunk in enumerate(resp.parse()):
                if i == cut:
                    signal_replica(sims, endpoint, signal.SIGKILL)
                ids.add(chunk.id)
                if chunk.usage is not None:
                    usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    text += choice.text
                    finish = choice.finish_reason or finish
        return text, finish, usage, ids

    whole = run(None)
    resumed = run(random.Random(7).randint(3, 40))
    assert resumed[:3] == whole[:3] and whole[1] == "length" and whole[2][1] == 80
    assert len(resumed[3]) == 1  # one id in every chunk
    assert migrations(gw).get("resumed", 0) == 1


def test_structured_output_is_not_resumed_but_ended_with_an_error_event(
        pair: tuple[list[SimProcess], GatewayProcess]) -> None:
    sims, gw = pair
    body = {"messages": [{"role": "user", "content": "json please"}], "max_tokens": 200,
            "extra_body": {"ignore_eos": True}, "response_format": {"type": "json_object"}}
    with pytest.raises(openai.APIError):
        chat(gw, body, cut=3, sims=sims)
    counts = migrations(gw)
    assert counts.get("refused") == 1 and counts.get("resumed", 0) == 0


def test_with_migration_off_a_broken_stream_ends_with_the_error_event_as_before() -> None:
    with running_sims([{"max_model_len": 8192} for _ in range(2)]) as sims:
        gw = gateway_for(sims, enabled=False)
        try:
            # nothing asks the replica for token ids the client did not ask for
            body = {"model": MODEL, "stream": True, "max_tokens": 12,
                    "messages": [{"role": "user", "content": "hello"}]}
            raw = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30).content
            assert b"[DONE]" in raw and b'"token_ids":[' not in raw and b'"prompt_token_ids":[' not in raw
            with pytest.raises(openai.APIError):
                chat(gw, CASES["chat_plain"], cut=3, sims=sims)
            assert migrations(gw).get("resumed", 0) == 0
        finally:
            gw.stop()


def test_a_responses_stream_cut_mid_way_ends_with_its_error_event_and_counts_refused(
        pair: tuple[list[SimProcess], GatewayProcess]) -> None:
    """vLLM returns no token ids for a Responses stream, so it cannot be resumed token for token: it ends with the
    Responses API's own error event, counted `refused` (docs/reliability.md, "Stream migration")."""
    sims, gw = pair
    body = {"model": MODEL, "stream": True, "input": "tell me a long story", "max_output_tokens": 200,
            "temperature": 0}
    events = b""
    with httpx.stream("POST", gw.base_url + "/responses", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for i, chunk in enumerate(resp.iter_raw()):
            if i == 3:
                signal_replica(sims, resp.headers["x-m3gate-endpoint"], signal.SIGKILL)
            events += chunk
    assert b"event: error" in events and b"response.completed" not in events
    assert migrations(gw).get("refused") == 1 and migrations(gw).get("resumed", 0) == 0


def test_when_every_replica_breaks_the_stream_it_ends_with_the_error_event_and_counts_failed() -> None:
    with running_sims([{"max_model_len": 8192} for _ in range(2)]) as sims:
        gw = gateway_for(sims, max_migrations=2)
        try:
            for sim in sims:
                sim.set_faults(drop_mid_stream=1.0)
            with pytest.raises(openai.APIError):
                chat(gw, CASES["chat_plain"])
            counts = migrations(gw)
            assert counts.get("failed") == 1, counts
        finally:
            gw.stop()


def test_a_stream_aborted_by_a_shutdown_is_resumed() -> None:
    """vLLM with --shutdown-timeout 0 (its default) ends the streams in flight with finish_reason "abort" on
    SIGTERM."""
    with running_sims([{"max_model_len": 8192, "extra_args": ["--shutdown-timeout", "0"]}
                       for _ in range(2)]) as sims:
        gw = gateway_for(sims)
        try:
            body = CASES["chat_reasoning"]
            whole = chat(gw, body)
            answer = chat(gw, body, cut=5, sims=sims, how=signal.SIGTERM)
            assert comparable(answer) == comparable(whole)
            assert migrations(gw).get("resumed") == 1
        finally:
            gw.stop()


def test_a_stream_gone_silent_past_the_shutdown_timeout_is_resumed_after_the_stall_timeout() -> None:
    """With --shutdown-timeout N a draining vLLM keeps streaming for N s; then the stream goes silent, left open."""
    with running_sims([{"max_model_len": 8192, "extra_args": ["--shutdown-timeout", "1"]}
                       for _ in range(2)]) as sims:
        gw = gateway_for(sims)
        try:
            body = {**CASES["chat_plain"], "max_tokens": 400}
            whole = chat(gw, body)
            started = time.monotonic()
            answer = chat(gw, body, cut=5, sims=sims, how=signal.SIGTERM)
            assert comparable(answer) == comparable(whole)
            assert time.monotonic() - started > 2.5  # the shutdown timeout, then the stall timeout
            assert migrations(gw).get("resumed") == 1
        finally:
            gw.stop()
