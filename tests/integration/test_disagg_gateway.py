"""A disaggregated pool end to end: the OpenAI SDK through the gateway to simulated prefill and decode replicas that
speak vLLM 0.32's NIXL protocol (pools/sim/disagg.py). Chat, completions, streaming, tools and reasoning; the
decider; prefill, decode and transfer failures; in-flight counts and admission tickets back to zero; metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
MIN_UNCACHED = 1024
CLEAR = dict(error_rate=0.0, hang=False, added_latency_ms=0, unhealthy=False, refuse_connections=False)


def sim(role: str) -> SimProcess:
    return start_sim(65536, extra_args=["--role", role, "--speed", "20", "--seed", "5"])


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, list[SimProcess]]]:
    started: list[SimProcess] = []
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            started.append(sim(role))
        yield {"prefill": started[:2], "decode": started[2:]}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def gateway(replicas: dict[str, list[SimProcess]]) -> Iterator[GatewayProcess]:
    gw = start_gateway({
        "model": MODEL,
        "pools": [{
            "name": "extended", "max_model_len": 65536,
            "disaggregation": {
                "prefill": {"endpoints": [s.url for s in replicas["prefill"]]},
                "decode": {"endpoints": [s.url for s in replicas["decode"]]},
                "min_uncached_tokens": MIN_UNCACHED, "transfer_timeout_s": 1.5,
            },
        }],
        "server": {"health_interval_s": 0.3, "upstream_read_timeout_s": 5},
        "classification": {"output_budget": {"adaptive": 256, "enabled": 512, "disabled": 128}},
    })
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(autouse=True)
def healthy(replicas: dict[str, list[SimProcess]], gateway: GatewayProcess) -> Iterator[None]:
    every = [*replicas["prefill"], *replicas["decode"]]
    for s in every:
        s.set_faults(**CLEAR)
    # ejections from an earlier test must not decide this one: wait until every replica is available again
    deadline = time.monotonic() + 35
    while time.monotonic() < deadline:
        pools = admin_pools(gateway)
        if all(r["available"] for r in pools["extended"]["replicas"].values()):
            break
        time.sleep(0.2)
    yield
    for s in every:
        s.set_faults(**CLEAR)


def pd_metrics(gateway: GatewayProcess) -> dict[str, float]:
    """The extended pool's P/D counters and histogram counts (summed over traffic classes) by sample name;
    decisions by `m3gate_pd_decisions_total{<path>}`. A sample not yet created reads as absent."""
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name.startswith("m3gate_pd_") and s.labels.get("pool") == "extended"
                    and s.name.endswith(("_total", "_count"))):
                key = s.name + (f"{{{s.labels['path']}}}" if "path" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def admin_pools(gateway: GatewayProcess) -> dict[str, Any]:
    return httpx.get(gateway.url + "/admin/pools", timeout=5).json()["pools"]


def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=30)


def long_text(tag: str, words: int = 3000) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def held_total(sims: list[SimProcess]) -> int:
    return sum(s.stats()["kv_transfer"]["held_total"] for s in sims)


def pulls(sims: list[SimProcess]) -> int:
    return sum(s.stats()["kv_transfer"]["pulls"] for s in sims)


def settled(gateway: GatewayProcess) -> None:
    """Every in-flight count is back to zero (guards released exactly once on every path)."""
    deadline = time.monotonic() + 5
    while True:
        replicas = admin_pools(gateway)["extended"]["replicas"]
        loads = {url: (r["in_flight"], r["in_flight_tokens"]) for url, r in replicas.items()}
        if all(v == (0, 0) for v in loads.values()):
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.1)
    gates = httpx.get(gateway.url + "/admin/traffic", timeout=5).json()["pools"]
    assert all(c["in_flight"] == 0 and c["queued"] == 0 for g in gates.values() for c in g["classes"].values()), gates


def test_config_puts_roles_on_replicas(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    pools = admin_pools(gateway)["extended"]["replicas"]
    assert {pools[s.url]["role"] for s in replicas["prefill"]} == {"prefill"}
    assert {pools[s.url]["role"] for s in replicas["decode"]} == {"decode"}
    targets = httpx.get(gateway.url + "/metrics/targets", timeout=5).json()
    assert sorted(t["labels"]["role"] for t in targets) == ["decode", "decode", "prefill", "prefill"]


def test_long_chat_is_prefilled_then_decoded(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    held, pulled = held_total(replicas["prefill"]), pulls(replicas["decode"])
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": long_text("a")}], max_tokens=12)
    answer = raw.parse()
    assert raw.headers["x-m3gate-endpoint"] in {s.url for s in replicas["decode"]}
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > MIN_UNCACHED
    assert answer.usage.completion_tokens == 12
    assert held_total(replicas["prefill"]) == held + 1 and pulls(replicas["decode"]) == pulled + 1
    settled(gateway)


def test_streamed_chat_with_reasoning_and_tools(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    held = held_total(replicas["prefill"])
    before = pd_metrics(gateway)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    stream = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long_text("b") + " what is the weather in Paris?"}],
        tools=tools, stream=True, stream_options={"include_usage": True}, max_tokens=200,
        extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    reasoning = content = ""
    calls: list[Any] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
            calls.extend(delta.tool_calls or [])
    assert reasoning, "reasoning deltas reach the client"
    assert calls or content
    assert usage is not None and usage.prompt_tokens > MIN_UNCACHED
    assert held_total(replicas["prefill"]) == held + 1
    settled(gateway)
    # one disaggregated decision and each stage observed once (the decode stage when the request's record closes)
    expected = {"m3gate_pd_decisions_total{disaggregated}": 1.0, "m3gate_pd_prefill_seconds_count": 1.0,
                "m3gate_pd_transfer_seconds_count": 1.0, "m3gate_pd_decode_seconds_count": 1.0}
    deadline = time.monotonic() + 5
    while moved(before, pd_metrics(gateway)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert moved(before, pd_metrics(gateway)) == expected


def test_completions_streamed_and_not(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    c = client(gateway)
    held = held_total(replicas["prefill"])
    plain = c.completions.create(model=MODEL, prompt=long_text("c"), max_tokens=8)
    assert plain.usage is not None and plain.usage.completion_tokens == 8
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=long_text("d"), max_tokens=8, stream=True) if ch.choices)
    assert text
    assert held_total(replicas["prefill"]) == held + 2
    settled(gateway)


def test_cached_tokens_come_from_the_prefill_side(gateway: GatewayProcess) -> None:
    c = client(gateway)
    messages = [{"role": "user", "content": long_text("e")}]
    c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    again = c.chat.completions.create(model=MODEL, messages=[*messages, {"role": "assistant", "content": "ok"},
                                                             {"role": "user", "content": long_text("f", 1500)}],
                                      max_tokens=4)
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and (details.cached_tokens or 0) > 0  # the prefill replica's prefix hits


def test_short_prompt_goes_straight_to_decode(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    held = held_total(replicas["prefill"])
    before = pd_metrics(gateway)
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4)
    assert raw.headers["x-m3gate-endpoint"] in {s.url for s in replicas["decode"]}
    assert held_total(replicas["prefill"]) == held
    settled(gateway)
    # one decode_short decision, and no prefill, transfer or decode stage observed
    assert moved(before, pd_metrics(gateway)) == {"m3gate_pd_decisions_total{decode_short}": 1.0}


def test_a_failing_prefill_replica_is_retried_on_another(
    gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]
) -> None:
    bad, good = replicas["prefill"]
    bad.set_faults(error_rate=1.0)
    held = good.stats()["kv_transfer"]["held_total"]
    for i in range(3):
        answer = client(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text(f"g{i}")}], max_tokens=4)
        assert answer.choices[0].message.content
    assert good.stats()["kv_transfer"]["held_total"] == held + 3
    settled(gateway)


def test_no_prefill_replica_left_means_decode_prefills(
    gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]
) -> None:
    for s in replicas["prefill"]:
        s.set_faults(error_rate=1.0)
    pulled = pulls(replicas["decode"])
    answer = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long_text("h")}], max_tokens=4)
    assert answer.choices[0].message.content
    assert pulls(replicas["decode"]) == pulled
    settled(gateway)


def test_decode_failure_retries_decode_elsewhere_and_prefills_again(
    gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]
) -> None:
    bad, good = replicas["decode"]
    bad.set_faults(error_rate=1.0)
    tried_bad = 0
    for i in range(8):  # idle and alike, the decode replicas rank by a hash of the prompt: some go to bad first
        stream = bool(i % 2)
        held, errors = held_total(replicas["prefill"]), bad.stats()["injected_errors"]
        raw = client(gateway).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": long_text(f"i{i}")}], max_tokens=4,
            stream=stream)
        assert raw.headers["x-m3gate-endpoint"] == good.url
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        # when the bad replica was tried first it answered (a 500): the blocks may have been read and freed, so
        # the request was prefilled again before the other decode replica got it
        failed = bad.stats()["injected_errors"] - errors
        tried_bad += failed
        assert held_total(replicas["prefill"]) == held + 1 + failed
    assert tried_bad >= 1
    settled(gateway)


def test_a_transfer_that_never_completes_times_out(
    gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]
) -> None:
    for s in replicas["decode"]:
        s.set_faults(added_latency_ms=4000)
    r = httpx.post(gateway.base_url + "/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": long_text("k")}], "max_tokens": 4, "stream": True})
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "kv_transfer_timeout"
    assert "did not complete within 1.5 s" in r.json()["error"]["message"]
    settled(gateway)


def test_the_pd_dashboard_reads_metrics_that_exist(
    gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]
) -> None:
    """Every series deploy/grafana/m3gate-pd.json queries is exported, by the gateway or by the replicas (whose
    `role` and `pool` labels come from the gateway's /metrics/targets, checked in test_config_puts_roles_...)."""
    import json  # noqa: PLC0415
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "m3gate-pd.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", e)}
    exported = httpx.get(gateway.url + "/metrics", timeout=5).text
    exported += "".join(httpx.get(s.url + "/metrics", timeout=5).text for s in (*replicas["prefill"], *replicas["decode"]))
    missing = sorted(n for n in names if not re.search(rf"^{re.escape(n)}[{{ ]", exported, re.M))
    assert len(names) >= 9 and missing == []


def test_classes_admission_and_rate_limits_apply(replicas: dict[str, list[SimProcess]]) -> None:
    """A disaggregated pool is admitted like any pool: its class's concurrency (held through prefill and decode),
    queue and a key's requests per minute."""
    import hashlib  # noqa: PLC0415
    import threading  # noqa: PLC0415

    key = "sk-pd-test"
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "extended", "max_model_len": 65536, "disaggregation": {
            "prefill": {"endpoints": [s.url for s in replicas["prefill"]]},
            "decode": {"endpoints": [s.url for s in replicas["decode"]]}, "min_uncached_tokens": MIN_UNCACHED}}],
        "server": {"health_interval_s": 0.3},
        "traffic": {"classes": {"batch": {"max_concurrency": 1, "queue_length": 0, "ttft_target_s": 60}}},
        "access": {"keys": [{"name": "pd", "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                             "requests_per_minute": 3}]},
    })
    try:
        for s in replicas["decode"]:
            s.set_faults(added_latency_ms=1500)  # the first request holds the class's one slot through its decode
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": long_text("m")}], "max_tokens": 4}
        first: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: first.update(r=httpx.post(
            gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)))
        thread.start()
        time.sleep(0.6)
        refused = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_capacity", refused.text
        thread.join(30)
        assert first["r"].status_code == 200
        for s in replicas["decode"]:
            s.set_faults(added_latency_ms=0)
        assert httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30).status_code == 200
        limited = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
        assert limited.status_code == 429, limited.text  # the 4th request of the minute
        gates = httpx.get(gw.url + "/admin/traffic", timeout=5).json()["pools"]
        assert all(c["in_flight"] == 0 for g in gates.values() for c in g["classes"].values()), gates
    finally:
        gw.stop()


def test_a_kv_load_failure_is_retried_after_prefilling_again(replicas: dict[str, list[SimProcess]]) -> None:
    """A prefill replica whose side channel cannot be reached (VLLM_NIXL_SIDE_CHANNEL_HOST pointing nowhere): the
    decode replica cannot load the blocks and fails the request as vLLM does (a 500, or when streaming a 200 with the
    role chunk then an error event). The gateway retries on the other decode replica after prefilling again, on the
    other prefill replica; the client never sees the failure."""
    broken = start_sim(65536, extra_args=["--role", "prefill", "--speed", "20"],
                       env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.9"})
    good = replicas["prefill"][1]
    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "extended", "max_model_len": 65536, "disaggregation": {
            "prefill": {"endpoints": [broken.url, good.url]},
            "decode": {"endpoints": [s.url for s in replicas["decode"]]}, "min_uncached_tokens": MIN_UNCACHED}}],
        "server": {"health_interval_s": 0.3},
    })
    try:
        failed = sum(s.stats()["kv_transfer"]["failed_pulls"] for s in replicas["decode"])
        c = client(gw)
        for i in range(8):
            messages = [{"role": "user", "content": long_text(f"n{i}")}]
            if i % 2:
                answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
                assert answer.choices[0].message.content
            else:
                stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
                assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert broken.stats()["kv_transfer"]["held_total"] >= 1, "the broken prefill replica was never chosen"
        assert sum(s.stats()["kv_transfer"]["failed_pulls"] for s in replicas["decode"]) > failed
        pools = admin_pools(gw)["extended"]["replicas"]
        for s in replicas["decode"]:  # not blamed for the prefill side's fault
            assert pools[s.url]["consecutive_failures"] == 0 and pools[s.url]["ejected_for_s"] == 0, pools[s.url]
        assert all(r["in_flight"] == 0 for r in pools.values())
    finally:
        gw.stop()
        broken.stop()


def test_draining_a_prefill_replica(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    drained, other = replicas["prefill"]
    r = httpx.post(gateway.url + "/admin/replicas/drain", json={"endpoint": drained.url}, timeout=5)
    assert r.status_code == 200 and r.json()["pool"] == "extended"
    try:
        assert admin_pools(gateway)["extended"]["replicas"][drained.url]["draining"] is True
        held = drained.stats()["kv_transfer"]["held_total"], other.stats()["kv_transfer"]["held_total"]
        for i in range(3):
            client(gateway).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long_text(f"o{i}")}], max_tokens=4)
        assert drained.stats()["kv_transfer"]["held_total"] == held[0]
        assert other.stats()["kv_transfer"]["held_total"] == held[1] + 3
    finally:
        httpx.post(gateway.url + "/admin/replicas/undrain", json={"endpoint": drained.url}, timeout=5)


def test_a_reload_turns_a_pool_disaggregated(replicas: dict[str, list[SimProcess]]) -> None:
    """Aggregated decode replicas, then the same pool disaggregated by a hot reload (kept replicas keep their state)."""
    plain = {"model": MODEL, "server": {"health_interval_s": 0.3},
             "pools": [{"name": "extended", "max_model_len": 65536, "endpoints": [s.url for s in replicas["decode"]]}]}
    gw = start_gateway(plain)
    try:
        held = held_total(replicas["prefill"])
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text("p")}],
                                           max_tokens=4)
        assert held_total(replicas["prefill"]) == held
        gw.write_config({**plain, "pools": [{"name": "extended", "max_model_len": 65536, "disaggregation": {
            "prefill": {"endpoints": [s.url for s in replicas["prefill"]]},
            "decode": {"endpoints": [s.url for s in replicas["decode"]]}, "min_uncached_tokens": MIN_UNCACHED}}]})
        r = httpx.post(gw.url + "/admin/reload", timeout=10)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while {r["role"] for r in admin_pools(gw)["extended"]["replicas"].values()} != {"prefill", "decode"}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)  # the new prefill replicas' first health check
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text("q")}],
                                           max_tokens=4)
        assert held_total(replicas["prefill"]) == held + 1
    finally:
        gw.stop()


def test_a_prefill_4xx_is_the_clients_answer(gateway: GatewayProcess, replicas: dict[str, list[SimProcess]]) -> None:
    held, pulled = held_total(replicas["prefill"]), pulls(replicas["decode"])
    r = httpx.post(gateway.base_url + "/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": long_text("r")}], "max_tokens": 4,
        "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
    assert r.headers["x-m3gate-endpoint"] in {s.url for s in replicas["prefill"]}
    assert held_total(replicas["prefill"]) == held and pulls(replicas["decode"]) == pulled
    pools = admin_pools(gateway)["extended"]["replicas"]
    for s in replicas["prefill"]:  # the request's fault, not the replica's
        assert pools[s.url]["consecutive_failures"] == 0 and pools[s.url]["ejected_for_s"] == 0, pools[s.url]
    settled(gateway)
