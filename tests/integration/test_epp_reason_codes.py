"""Reason-coded answers behind Envoy (`m3gate epp`, full response processing): a refusal carries its code in
`x-m3gate-refusal` and `x-m3gate-queue-ms`, and a served answer its queue time, as `m3gate serve` sends them."""

from __future__ import annotations

import httpx

from tests.integration.test_epp_keys import CLIENT_KEY, MODEL, KeyedPair, keyed  # noqa: F401 - the fixture

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_a_refusal_behind_envoy_names_its_code(keyed: KeyedPair) -> None:  # noqa: F811 - the fixture
    resp = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert resp.headers["x-m3gate-refusal"] == "invalid_api_key"
    assert resp.headers["x-m3gate-queue-ms"] == "0"


def test_a_served_answer_behind_envoy_says_how_long_it_queued(keyed: KeyedPair) -> None:  # noqa: F811
    for stream in (False, True):
        resp = httpx.post(keyed.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30,
                          headers={"authorization": f"Bearer {CLIENT_KEY}", "x-m3gate-pool": "interactive"})
        assert resp.status_code == 200, resp.text[:300]
        assert resp.headers["x-m3gate-queue-ms"] == "0"  # nothing waited
        assert "x-m3gate-refusal" not in resp.headers
