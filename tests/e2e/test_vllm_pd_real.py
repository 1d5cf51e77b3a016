"""Real prefill/decode disaggregation: a vLLM CPU prefill server and a decode server joined by NixlConnector (UCX,
DRAM to DRAM), driven directly with vLLM's toy-proxy protocol (no gateway): prefill with max_tokens 1 and
`do_remote_decode`, then decode with the prefill answer's `kv_transfer_params`.

The decode server must not compute the prompt: it pulls the prefill server's blocks, and its logprobs are those the
prefill server gets for the same prompt (bit-identical on this build); fed another request's blocks they differ.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policies.vllm_wire import decode_body, prefill_body
from pools.vllm_local.pd import PdPair, start_pd_pair
from tests.vllm_fixtures import SKIP_ENV, vllm_skipped

# the first test's setup boots the pair: ~2-6 minutes on a 2-core machine
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_pd, pytest.mark.timeout(900)]

MODEL = "MiniMaxAI/MiniMax-M3"
BLOCK_SIZE = 128
VOCAB = "agent tool result file patch test repository function error trace build log diff commit".split()
TIMEOUT = httpx.Timeout(300.0, connect=10.0)  # a ceiling: answers take seconds (tens while the pair warms up)


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[PdPair]:
    if vllm_skipped():
        pytest.skip(f"{SKIP_ENV}=1")
    # vLLM's default 30 s lease: the prefill server steps every millisecond while it holds blocks no decode server
    # will pull (a failed handshake, the restarted-prefill test, which runs last for that reason).
    pair = start_pd_pair(2048, extra_config={"kv_lease_duration": 30})
    try:
        _handshake(pair)
        yield pair
    finally:
        pair.stop()


def _handshake(pair: PdPair, attempts: int = 5) -> None:
    """One request through the pair until the decode server's NIXL handshake with the prefill server succeeds. vLLM
    waits 5 s for the handshake's reply (a fixed zmq timeout in nixl/base_worker.py); the first one, UCX setting up,
    can take longer on a slow 2-core machine and fails that request with a 500. Once made, it is reused, so the tests'
    own metric deltas start after it. An attempt that hangs is given up after 90 s (the decode server answers in
    seconds once `start_pd_pair` has spread its threads; see `spread_affinity`)."""
    body = {"model": MODEL, "prompt": token_prompt(99, 300), "max_tokens": 2, "temperature": 0}
    outcomes = []
    with httpx.Client(timeout=httpx.Timeout(90.0, connect=10.0)) as c:
        for _ in range(attempts):
            prefilled = post(c, pair.prefill.url, prefill_body(body))
            try:
                status = c.post(pair.decode.url + "/v1/completions", json=decode_body(body, prefilled["kv_transfer_params"])).status_code
            except httpx.TimeoutException:
                status = "timeout"
            if status == 200:
                return
            outcomes.append(status)
            time.sleep(2)
    raise AssertionError(f"the decode server's NIXL handshake with the prefill server failed {attempts} times: "
                         f"{outcomes}")


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as c:
        yield c


def words(seed: int, n: int = 200) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def metrics(client: httpx.Client, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(client.get(url + "/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("engine", "model_name")))
            values[(sample.name, labels)] = sample.value
    return values


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prefill(client: httpx.Client, pair: PdPair, body: dict[str, Any]) -> dict[str, Any]:
    answer = post(client, pair.prefill.url, prefill_body(body))
    params = answer["kv_transfer_params"]
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_mode"] == "pull"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == pair.prefill.ports["nixl_side_channel_port"]
    assert params["remote_num_tokens"] == prompt_tokens
    assert params["remote_request_id"].startswith(answer["id"])
    # One list per KV-cache group; every block of the prompt, the partial last one included.
    assert [len(group) for group in params["remote_block_ids"]] == [-(-prompt_tokens // BLOCK_SIZE)]
    assert params["remote_prefill_cached_tokens"] == answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert answer["usage"]["completion_tokens"] == 1
    return answer


def logprobs(answer: dict[str, Any]) -> list[float]:
    return answer["choices"][0]["logprobs"]["token_logprobs"]


def token_prompt(seed: int, n: int = 600) -> list[int]:
    """Token ids (no special tokens), so that prompts of one length fill the same number of blocks."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1018) for _ in range(n)]


def test_decode_pulls_the_prompt_from_the_prefill_server(pd_pair: PdPair, client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": token_prompt(1), "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": 3}
    prefilled = prefill(client, pd_pair, body)
    prompt_tokens = prefilled["usage"]["prompt_tokens"]
    assert prompt_tokens == 600

    before = metrics(client, pd_pair.decode.url)
    decoded = post(client, pd_pair.decode.url, decode_body(body, prefilled["kv_transfer_params"]))
    after = metrics(client, pd_pair.decode.url)

    assert decoded["kv_transfer_params"] is None
    assert decoded["usage"]["prompt_tokens"] == prompt_tokens
    assert decoded["usage"]["completion_tokens"] == 3
    # vLLM reports the prefill side's own prefix hits here (forwarded as remote_prefill_cached_tokens), not the
    # decode side's near-100% (local hits + pulled tokens).
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        prefilled["kv_transfer_params"]["remote_prefill_cached_tokens"])
    assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") == 1
    assert delta(after, before, "vllm:nixl_num_failed_transfers_total") == 0
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == prompt_tokens
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert delta(after, before, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == prompt_tokens

    # The answer is what the prefill server computes itself from the same prompt (its prefix cache holds it).
    reference = post(client, pd_pair.prefill.url, body)
    assert decoded["choices"][0]["text"] == reference["choices"][0]["text"]
    assert logprobs(decoded) == pytest.approx(logprobs(reference), abs=1e-4)


def test_decode_from_another_requests_blocks_answers_otherwise(pd_pair: PdPair, client: httpx.Client) -> None:
    """The control: a fresh prompt decoded from the blocks of another prompt of the same length gets other logprobs
    than the prefill server computes for it, so the decode side really uses the pulled KV."""
    donor = {"model": MODEL, "prompt": token_prompt(2), "max_tokens": 3, "temperature": 0, "ignore_eos": True,
             "logprobs": 3}
    body = {**donor, "prompt": token_prompt(3)}
    donor_params = prefill(client, pd_pair, donor)["kv_transfer_params"]
    decoded = post(client, pd_pair.decode.url, decode_body(body, donor_params))
    reference = post(client, pd_pair.prefill.url, body)  # computed locally there: it never saw this prompt
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert abs(logprobs(decoded)[0] - logprobs(reference)[0]) > 1e-3


def test_streamed_chat_decode(pd_pair: PdPair, client: httpx.Client) -> None:
    """What a gateway sends: a streamed chat request; the prefill leg is forced to non-streaming, max_tokens 1."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(300, 250)}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    resp = client.post(pd_pair.prefill.url + "/v1/chat/completions", json=prefill_body(body))
    assert resp.status_code == 200, resp.text
    prefilled = resp.json()
    assert prefilled["kv_transfer_params"]["do_remote_prefill"] is True

    before = metrics(client, pd_pair.decode.url)
    events = []
    with client.stream("POST", pd_pair.decode.url + "/v1/chat/completions",
                       json=decode_body(body, prefilled["kv_transfer_params"])) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    after = metrics(client, pd_pair.decode.url)

    assert not any("error" in e for e in events), events
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == prefilled["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 4
    assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") == 1
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == (
        usage["prompt_tokens"])


def test_through_m3gate_with_the_openai_sdk(pd_pair: PdPair, client: httpx.Client) -> None:
    """The whole product path: the OpenAI SDK → m3gate with a disaggregated pool over the real prefill and decode
    servers → one ordinary streamed answer, whose prompt the decode server pulled over NIXL."""
    import openai

    from gateway.cli.launcher import start_gateway

    gw = start_gateway({
        "model": MODEL,
        "pools": [{"name": "extended", "max_model_len": 2048, "disaggregation": {
            "prefill": {"endpoints": [pd_pair.prefill.url]}, "decode": {"endpoints": [pd_pair.decode.url]},
            "min_uncached_tokens": 256, "kv_lease_s": 30, "transfer_timeout_s": 240}}],
        "server": {"health_interval_s": 1.0, "upstream_read_timeout_s": 300},
        "classification": {"output_budget": {"adaptive": 64, "enabled": 64, "disabled": 64}},
    }, timeout=180)  # the two vLLM servers beside it may hold the machine's two cores for a while
    try:
        # a client waits for readiness (its monitor has found both roles healthy): a health probe that timed out
        # while the gateway itself was starting on the busy cores leaves the pool unavailable for a second
        deadline = time.monotonic() + 120.0
        while client.get(gw.url + "/ready", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        sdk = openai.OpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=300)
        before = metrics(client, pd_pair.decode.url)
        stream = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(400, 300)}], max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        after = metrics(client, pd_pair.decode.url)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 4 and usage.prompt_tokens > 256
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # an ordinary answer
        assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") == 1  # one pull, by the decode server
        assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == (
            usage.prompt_tokens)
        decisions = {(s.labels.get("path")): s.value for f in text_string_to_metric_families(
            client.get(gw.url + "/metrics").text) for s in f.samples if s.name == "m3gate_pd_decisions_total"}
        assert decisions.get("disaggregated") == 1
    finally:
        gw.stop()


def test_decode_for_a_restarted_prefill_server_fails(pd_pair: PdPair, client: httpx.Client) -> None:
    """`remote_engine_id` no longer the prefill server's (it restarted): the handshake answers with another engine id
    and, with kv_load_failure_policy `fail`, the request ends with finish_reason `error`: a bare 500."""
    body = {"model": MODEL, "prompt": token_prompt(4, 300), "max_tokens": 2, "temperature": 0}
    params = prefill(client, pd_pair, body)["kv_transfer_params"]
    stale = {**params, "remote_engine_id": "00000000-0000-4000-8000-000000000000"}
    before = metrics(client, pd_pair.decode.url)
    resp = client.post(pd_pair.decode.url + "/v1/completions", json=decode_body(body, stale))
    after = metrics(client, pd_pair.decode.url)
    assert resp.status_code == 500
    assert resp.json() == {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                                     "code": 500}}
    assert delta(after, before, "vllm:nixl_num_failed_transfers_total") >= 1
    assert delta(after, before, "vllm:request_success_total", finished_reason="error") == 1
