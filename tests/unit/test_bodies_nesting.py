"""gateway/bodies.py's nesting check walks containers instead of writing the body back with orjson: it must refuse
exactly what orjson.dumps cannot write (the gateway writes bodies back: model alias, stream_options, /tokenize)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.bodies import MAX_NESTING, _too_deep, parse_json_object
from policies.errors import RequestRejected


def _writable(body: dict) -> bool:
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(min_value=MAX_NESTING - 6, max_value=MAX_NESTING + 6),
       kinds=st.lists(st.booleans(), min_size=1, max_size=8),
       leaf=st.sampled_from([[], {}, 1, "text", [1], {"z": 2}, None]),
       siblings=st.integers(min_value=0, max_value=3))
def test_refuses_exactly_what_orjson_cannot_write(depth: int, kinds: list[bool], leaf: object, siblings: int) -> None:
    value: object = leaf
    for i in range(depth - 1):
        value = [value, *range(siblings)] if kinds[i % len(kinds)] else {"k": value, "s": "x" * siblings}
    body = {"messages": [{"role": "user", "content": "hi"}], "a": value}
    assert _too_deep(body) is not _writable(body)


def test_a_deep_body_is_a_400_and_a_bracket_heavy_prompt_is_not() -> None:
    deep = b'{"a":' + b"[" * 300 + b"]" * 300 + b"}"
    with pytest.raises(RequestRejected) as refused:
        parse_json_object(deep)
    assert refused.value.status == 400 and "nested too deeply" in refused.value.message
    code = {"messages": [{"role": "user", "content": "[{" * 5000}]}  # brackets in text: past the cheap filter
    assert parse_json_object(orjson.dumps(code)) == code
