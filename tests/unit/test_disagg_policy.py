"""policies/disagg.py: the P/D decider and the decode replica's ranking, on crafted snapshots; gateway/disagg.py's
protocol helpers (the prefill body, telling vLLM's failed-load stream from a first token)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.disagg import _first_token_ok
from policies.vllm_wire import prefill_body
from policies.disagg import (
    DECODE_CACHED,
    DECODE_NO_PREFILL,
    DECODE_SHORT,
    DECODE_UNSUPPORTED,
    DISAGGREGATED,
    DecodeParams,
    decide,
    decode_load,
    kv_headroom,
    rank_decode,
)
from policies.snapshot import NoReplicaAvailable, ReplicaSnapshot, RoutingRequest


@pytest.mark.parametrize(
    ("prompt", "cached", "prefill_up", "api", "path", "uncached"),
    [
        (100_000, 0, True, "chat", DISAGGREGATED, 100_000),
        (100_000, 98_000, True, "chat", DECODE_CACHED, 2_000),  # long but cached on the decode replica
        (3_000, 0, True, "chat", DECODE_SHORT, 3_000),
        (4_096, 0, True, "completions", DISAGGREGATED, 4_096),  # the threshold itself is disaggregated
        (100_000, 0, False, "chat", DECODE_NO_PREFILL, 100_000),
        (100_000, 0, True, "responses", DECODE_UNSUPPORTED, 100_000),
        (100_000, 120_000, True, "chat", DECODE_CACHED, 0),  # a match longer than the estimate
    ],
)
def test_decider(prompt: int, cached: int, prefill_up: bool, api: str, path: str, uncached: int) -> None:
    decision = decide(prompt, cached, 4096, prefill_up, api)
    assert (decision.path, decision.uncached_tokens) == (path, uncached)
    assert decision.disaggregated == (path == DISAGGREGATED)


def test_zero_threshold_disaggregates_everything() -> None:
    assert decide(1, 0, 0, True).disaggregated


def snap(url: str, **kw: object) -> ReplicaSnapshot:
    base: dict[str, object] = {"url": url, "pool": "extended", "kv_blocks": 1000, "block_size": 128,
                               "metrics_age_s": 0.5, "running": 0.0, "waiting": 0.0, "kv_usage": 0.1}
    base.update(kw)
    return ReplicaSnapshot(**base)  # type: ignore[arg-type]


REQ = RoutingRequest(prompt_tokens=64_000, output_budget=4_000)  # 532 blocks of 128


def test_decode_prefers_the_less_loaded() -> None:
    d = rank_decode(REQ, [snap("a", running=12.0), snap("b", running=2.0)])
    assert d.replica == "b" and d.fallbacks == ("a",)


def test_decode_avoids_a_replica_the_blocks_would_not_fit() -> None:
    # "a" is idle but 60% full: 400 free blocks < 532 needed; "b" is busier with room
    d = rank_decode(REQ, [snap("a", kv_usage=0.6), snap("b", running=4.0, kv_usage=0.1)])
    assert d.replica == "b" and d.reason == "decode_load_kv"
    every = rank_decode(REQ, [snap("a", kv_usage=0.6), snap("b", kv_usage=0.7)])
    assert every.replica == "a" and every.reason == "decode_kv_full"  # the least bad is still used


def test_decode_headroom_counts_the_expected_output_not_the_whole_budget() -> None:
    # 64K prompt + 32K budget = 750 blocks; with the output estimated at 500 tokens, 504: "a" (idle, 45% full,
    # 550 blocks free) takes it; counted at the budget it would not fit and busier "b" would
    budget = RoutingRequest(prompt_tokens=64_000, output_budget=32_000)
    estimated = RoutingRequest(prompt_tokens=64_000, output_budget=32_000, output_estimate=500)
    assert budget.expected_output == 32_000 and estimated.expected_output == 500
    replicas = [snap("a", kv_usage=0.45), snap("b", running=4.0, kv_usage=0.1)]
    assert rank_decode(budget, replicas).replica == "b"
    assert rank_decode(estimated, replicas).replica == "a"


def test_decode_kv_headroom_breaks_load_ties() -> None:
    d = rank_decode(REQ, [snap("a", kv_usage=0.3), snap("b", kv_usage=0.05)])
    assert d.replica == "b"


def test_decode_trusts_in_flight_over_stale_scrapes() -> None:
    params = DecodeParams()
    assert decode_load(snap("a", running=1.0, in_flight=5), params) == 5.0
    assert decode_load(snap("a", running=9.0, waiting=2.0, in_flight=5), params) == 11.0
    assert decode_load(snap("a", running=9.0, metrics_age_s=60.0, in_flight=2), params) == 2.0
    assert kv_headroom(snap("a", kv_blocks=None), 10) is None
    d = rank_decode(REQ, [snap("a", running=9.0, metrics_age_s=60.0, in_flight=0),
                          snap("b", running=0.0, in_flight=3)])
    assert d.replica == "a"


def test_decode_skips_unhealthy_and_draining() -> None:
    d = rank_decode(REQ, [snap("a", healthy=False), snap("b", draining=True, running=0.0), snap("c", running=30.0)])
    assert d.replica == "c" and d.fallbacks == ()
    with pytest.raises(NoReplicaAvailable):
        rank_decode(REQ, [snap("a", healthy=False)])


def test_prefill_body_is_the_toy_proxys() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 500, "max_completion_tokens": 500, "min_tokens": 10, "tools": []}
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out and out["tools"] == []
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                         "remote_port": None}
    assert body["max_tokens"] == 500 and body["stream"] is True  # the decode request keeps the client's own
    assert "max_completion_tokens" not in prefill_body({"max_tokens": 3})


ROLE = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n')
TOKEN = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
         b'"delta":{"content":"The"},"logprobs":null,"finish_reason":null}]}\n\n')
ERROR = (b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
         b'"code": 500}}\n\n')


class _Relay:
    """A StreamRelay's read-ahead over a replica's chunks."""

    def __init__(self, first: bytes, rest: list[bytes]) -> None:
        self.first_chunk = first
        self.rest = rest

    async def read_ahead(self) -> bytes:
        more = self.rest.pop(0) if self.rest else b""
        self.first_chunk += more
        return more


@pytest.mark.parametrize(
    ("first", "rest", "ok", "kept"),
    [
        (ROLE, [TOKEN], True, ROLE + TOKEN),  # the role chunk comes with the first token: read on to it
        (ROLE + TOKEN, [], True, ROLE + TOKEN),
        (ROLE, [ERROR + b"data: [DONE]\n\n"], False, None),  # vLLM's failed KV load, streamed
        (ERROR, [], False, None),  # completions: no role chunk
        (TOKEN, [], True, TOKEN),
    ],
)
def test_a_failed_kv_load_is_told_from_a_first_token(first: bytes, rest: list[bytes], ok: bool,
                                                    kept: bytes | None) -> None:
    relay = _Relay(first, list(rest))
    assert asyncio.run(_first_token_ok(relay)) is ok  # type: ignore[arg-type]
    if kept is not None:
        assert relay.first_chunk == kept  # nothing read ahead is lost: the relay sends it first


def test_idle_decode_replicas_are_spread_by_prompt_and_stable_per_prompt() -> None:
    replicas = [snap(u) for u in ("a", "b", "c", "d")]
    firsts = {rank_decode(RoutingRequest(64_000, 4_000, block_hashes=(h,)), replicas).replica for h in range(40)}
    assert len(firsts) >= 3  # not everyone on one replica
    one = RoutingRequest(64_000, 4_000, block_hashes=(7, 8))
    assert rank_decode(one, replicas).replica == rank_decode(one, list(reversed(replicas))).replica
