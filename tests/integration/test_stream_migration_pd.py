"""Stream migration on a disaggregated pool: simulated prefill and decode replicas (vLLM's NIXL protocol, greedy
mode) behind a real gateway, the OpenAI SDK as the client. The decode replica serving a prefilled stream is
SIGKILLed at a random chunk: the stream goes on on the other decode replica and comes out equal to the uninterrupted
answer. A prefill replica killed before its answer: the request is prefilled on the other one, as any prefill
failure is."""

from __future__ import annotations

import random
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims
from tests.integration.test_stream_migration import CASES, MODEL, USAGE, chat, client, comparable, signal_replica

POOL = "extended"
MIN_UNCACHED = 64
# long enough for the decider to send it through a prefill replica (least_loaded: the gateway knows no decode-side
# cache, so every turn of the same prompt is disaggregated again)
CONTEXT = " ".join(f"ctx{i}" for i in range(300))


class PD:
    """The pool's replicas by role and its gateway."""

    def __init__(self, prefill: list[SimProcess], decode: list[SimProcess], gw: GatewayProcess) -> None:
        self.prefill, self.decode, self.gw = prefill, decode, gw

    @property
    def every(self) -> list[SimProcess]:
        return [*self.prefill, *self.decode]


@pytest.fixture
def pd() -> Iterator[PD]:
    specs = [{"max_model_len": 8192, "extra_args": ["--role", role]}
             for role in ("prefill", "prefill", "decode", "decode")]
    with running_sims(specs) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": POOL, "max_model_len": 8192, "disaggregation": {
                "prefill": {"endpoints": [s.url for s in sims[:2]]},
                "decode": {"endpoints": [s.url for s in sims[2:]]},
                "min_uncached_tokens": MIN_UNCACHED}}],
            "server": {"health_interval_s": 0.3},
            "routing": {"policy": "least_loaded", "migration": {"stall_timeout_s": 1.5}},
        })
        try:
            yield PD(sims[:2], sims[2:], gw)
        finally:
            gw.stop()


def counters(gw: GatewayProcess) -> dict[str, float]:
    """The pool's migration outcomes and P/D decisions, e.g. {"resumed": 1, "disaggregated": 2}."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    out = {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'm3gate_stream_migrations_total\{{outcome="(\w+)",pool="{POOL}"\}} (\S+)', text)}
    for m in re.finditer(rf'm3gate_pd_decisions_total\{{path="(\w+)",pool="{POOL}"\}} (\S+)', text):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def requests_seen(sim: SimProcess) -> int:
    return sum(sim.stats()["requests"].values())


def pulls(sim: SimProcess) -> int:
    return sim.stats()["kv_transfer"]["pulls"]


def long_chat(case: str) -> dict[str, Any]:
    body = CASES[case]
    first = body["messages"][0]
    return {**body, "messages": [{"role": "user", "content": f"{CONTEXT}\n\n{first['content']}"}]}


@pytest.mark.parametrize("case", ["chat_reasoning", "chat_tool"])
def test_a_decode_replica_killed_mid_stream_is_resumed_on_the_other_decode_replica(pd: PD, case: str) -> None:
    body = long_chat(case)
    whole = chat(pd.gw, body)
    assert whole["finish"] in ("length", "tool_calls") and len(whole["ids"]) == 1
    assert whole["endpoint"] in {s.url for s in pd.decode}
    assert sum(pulls(s) for s in pd.decode) == 1  # the decode replica pulled the prefill replica's blocks
    cut = random.Random(case).randint(2, 12)
    resumed = chat(pd.gw, body, cut=cut, sims=pd.decode)
    assert comparable(resumed) == comparable(whole), f"cut after {cut} chunks"
    killed = next(s for s in pd.decode if s.url == resumed["endpoint"])
    other = next(s for s in pd.decode if s is not killed)
    assert killed._proc is not None and killed._proc.wait(5) == -signal.SIGKILL
    assert other.stats()["requests"].get("/v1/completions", 0) >= 1  # the resumed leg: a token-id continuation
    got = counters(pd.gw)
    assert got.get("resumed") == 1 and got.get("failed", 0) == 0 and got.get("disaggregated") == 2, got


def test_a_completion_on_a_killed_decode_replica_completes_exactly(pd: PD) -> None:
    def run(cut: int | None) -> tuple[str, str | None, tuple[int, int] | None, set[str], str]:
        text, finish, usage, ids = "", None, None, set()
        with client(pd.gw).completions.with_streaming_response.create(
                model=MODEL, prompt=f"{CONTEXT}\nWrite a story about ships.", max_tokens=80, temperature=0,
                stream=True, **USAGE) as resp:
            endpoint = resp.headers["x-m3gate-endpoint"]
            for i, chunk in enumerate(resp.parse()):
                if i == cut:
                    signal_replica(pd.decode, endpoint, signal.SIGKILL)
                ids.add(chunk.id)
                if chunk.usage is not None:
                    usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    text += choice.text
                    finish = choice.finish_reason or finish
        return text, finish, usage, ids, endpoint

    whole = run(None)
    seen = {s.url: requests_seen(s) for s in pd.decode}
    resumed = run(random.Random(7).randint(3, 40))
    assert resumed[:3] == whole[:3] and whole[1] == "length" and whole[2] is not None and whole[2][1] == 80
    assert len(resumed[3]) == 1  # one id in every chunk
    other = next(s for s in pd.decode if s.url != resumed[4])
    assert requests_seen(other) > seen[other.url]
    got = counters(pd.gw)
    assert got.get("resumed") == 1 and got.get("disaggregated") == 2, got


def test_a_prefill_replica_killed_before_its_answer_is_retried_on_the_other(pd: PD) -> None:
    body = long_chat("chat_reasoning")
    whole = chat(pd.gw, body)
    for s in pd.prefill:
        s.set_faults(hang=True)  # the prefill requests are accepted and not answered
    answer: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: answer.update(chat(pd.gw, body)))
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while not any(s.stats()["hung"] for s in pd.prefill):
            assert time.monotonic() < deadline, "no prefill replica got the request"
            time.sleep(0.05)
        killed = next(s for s in pd.prefill if s.stats()["hung"])
        other = next(s for s in pd.prefill if s is not killed)
        other.set_faults(hang=False)
        held = other.stats()["kv_transfer"]["held_total"]
        killed.kill()
    finally:
        worker.join(60)
    assert comparable(answer) == comparable(whole)
    assert other.stats()["kv_transfer"]["held_total"] == held + 1  # prefilled there, then decoded from its blocks
    got = counters(pd.gw)
    assert got.get("disaggregated") == 2 and got.get("resumed", 0) == 0, got
