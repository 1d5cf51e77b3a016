"""gateway/relay.py's upstream_payload: the bytes a replica gets. Fields the client did not send are spliced into its
own bytes; a field it sent with another value makes the gateway write the body again. Either way the replica must
parse exactly the intended body, with no duplicate member (Python's json keeps the last, others may not)."""

from __future__ import annotations

import json

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.relay import upstream_payload

MODEL = "MiniMaxAI/MiniMax-M3"
_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=8)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate members: {keys}"
    return dict(pairs)


@settings(max_examples=400, deadline=None)
@given(extra=st.dictionaries(st.sampled_from(["messages", "prompt", "max_tokens", "temperature", "tools", "x"]),
                             _values, max_size=4),
       model=st.sampled_from([None, MODEL, "alias"]),
       options=st.sampled_from([None, {}, {"include_usage": False}, {"include_usage": True}, {"continuous": True}]),
       priority=st.sampled_from([None, 0, 5]), sent_priority=st.sampled_from([None, 0, 7]),
       stream=st.booleans(), api=st.sampled_from(["chat", "completions", "responses"]),
       trailing=st.sampled_from(["", " ", "\n", " \r\n\t"]))
def test_the_replica_parses_exactly_the_intended_body(extra: dict, model: str | None, options: dict | None,
                                                      priority: int | None, sent_priority: int | None, stream: bool,
                                                      api: str, trailing: str) -> None:
    body = dict(extra)
    if model is not None:
        body["model"] = model
    if options is not None:
        body["stream_options"] = options
    if sent_priority is not None:
        body["priority"] = sent_priority
    raw = orjson.dumps(body) + trailing.encode()
    expected = dict(body)
    expected["model"] = MODEL
    if priority is not None:
        expected["priority"] = priority
    wants_usage = stream and api in ("chat", "completions") and not (
        isinstance(options, dict) and options.get("include_usage") is True)
    if wants_usage:
        expected["stream_options"] = {**(options or {}), "include_usage": True}

    payload, strip_usage = upstream_payload(dict(body), raw, api, MODEL, stream, priority)

    assert strip_usage is wants_usage
    assert json.loads(payload, object_pairs_hook=_no_duplicates) == expected == orjson.loads(payload)
    if expected == body:
        assert payload is raw  # nothing to change: the client's own bytes


def test_a_long_prompt_keeps_its_bytes_and_gains_the_usage_request() -> None:
    text = "def f(x):\n    return {'k': [x]}\n" * 20_000
    raw = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True})
    payload, strip_usage = upstream_payload(orjson.loads(raw), raw, "chat", MODEL, True)
    assert strip_usage and payload.startswith(raw[:-1]) and payload.endswith(b',"stream_options":{"include_usage":true}}')
