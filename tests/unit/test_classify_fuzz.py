"""Whatever JSON arrives, classify and choose_pool answer with a profile and a choice, or a RequestRejected: nothing else.

Bodies are drawn fully at random and also shaped like real requests of each API (the right keys, values mostly
right and sometimes anything), so the generator reaches deep into messages, content parts, tool calls and images.
`pytest --hypothesis-show-statistics` shows how often each API was profiled and each error code raised.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.pool_choice import choose_pool
from policies.tokens import TokenCounter
from policies.config import ClassificationConfig, PoolConfig

CFG = ClassificationConfig(full_count_below_chars=2_000)  # small, so the sampled path is fuzzed as well
COUNTER = TokenCounter(CFG)  # immutable apart from its cache: shared by the examples
POOLS = [
    PoolConfig(name="interactive", max_model_len=32_768),
    PoolConfig(name="repository", max_model_len=131_072, modalities=["text", "image"]),
    PoolConfig(name="extended", max_model_len=1_048_576, modalities=["text", "image", "video"]),
]


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` 15 times in 16: a body must get past its first checks for the deeper ones to be tested."""
    return st.integers(0, 15).flatmap(lambda i: other if i == 0 else valid)


def _header_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# Image headers with any width/height (including 0 and absurd ones), sometimes cut short.
image_headers = st.builds(
    lambda kind, w, h, cut: _header_b64({
        "png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + struct.pack(">II", w, h) + b"\x08\x02\x00\x00\x00",
        "gif": b"GIF89a" + struct.pack("<HH", w % 65536, h % 65536) + b"\x00" * 4,
        "jpeg": b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 9 + b"\xff\xc0\x00\x11\x08"
        + struct.pack(">HH", h % 65536, w % 65536) + b"\x03",
        "webp": b"RIFF\x00\x00\x00\x00WEBPVP8X\x0a\x00\x00\x00\x00\x00\x00\x00"
        + (w % 2**24).to_bytes(3, "little") + (h % 2**24).to_bytes(3, "little"),
    }[kind])[: None if cut is None else cut],
    st.sampled_from(["png", "gif", "jpeg", "webp"]), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
    st.one_of(st.none(), st.integers(0, 40)),
)
data_urls = st.builds(lambda mime, b64: f"data:{mime};base64,{b64}",
                      st.sampled_from(["image/png", "image/jpeg", "video/mp4", ""]), image_headers)
odd_strings = st.one_of(
    st.sampled_from(["", "\ud800", "a\udfffb", "<|endoftext|>", "data:,x", "data:image/png;base64,", "enabled",
                     "none", "https://example.com/a.png"]),
    st.builds(lambda n, c: c * n, st.integers(0, 4000), st.sampled_from(["x", "字", " ", "\n"])),
    data_urls,
)
texts = st.one_of(st.text(max_size=30), odd_strings)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), texts)
json_values = st.recursive(
    scalars, lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(texts, children, max_size=3)),
    max_leaves=12,
)


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(required, optional=optional or {})


PART_TYPES = ["text", "input_text", "output_text", "image_url", "input_image", "image", "video_url", "tool_use",
              "tool_result", "document", "thinking", "refusal", "redacted_thinking", "input_audio", "brand_new"]
urls = st.one_of(data_urls, texts, obj({"url": mostly(st.one_of(data_urls, texts), json_values)}), json_values)
sources = mostly(obj({"type": st.sampled_from(["base64", "url", "text", "content", "file"])},
                     {"data": st.one_of(image_headers, texts, json_values), "url": st.one_of(data_urls, texts),
                      "media_type": texts, "content": st.one_of(texts, st.lists(json_values, max_size=2))}),
                 json_values)
leaf_parts = obj({"type": mostly(st.sampled_from(PART_TYPES), json_values)},
                 {"text": mostly(texts, json_values), "image_url": urls, "video_url": urls, "source": sources,
                  "name": mostly(texts, json_values), "input": json_values, "thinking": texts, "refusal": texts})
parts = mostly(st.one_of(leaf_parts, obj({"type": st.just("tool_result")},
                                         {"content": st.one_of(texts, st.lists(leaf_parts, max_size=2))})),
               st.one_of(texts, json_values))
contents = mostly(st.one_of(texts, st.lists(parts, max_size=4)), json_values)
roles = mostly(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), json_values)
functions = mostly(obj({"name": mostly(texts, json_values)}, {"arguments": mostly(texts, json_values)}), json_values)
tool_calls = mostly(st.lists(mostly(obj({"function": functions}, {"id": texts, "type": texts}), json_values),
                             max_size=3), json_values)
chat_messages = mostly(obj({"role": roles}, {
    "content": contents, "name": json_values, "reasoning": mostly(texts, json_values),
    "reasoning_content": texts, "tool_calls": tool_calls, "tool_call_id": json_values,
}), json_values)
response_items = mostly(st.one_of(
    obj({"role": roles, "content": contents}, {"type": st.just("message")}),
    obj({"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "item_reference",
                                  "web_search_call"])},
        {"name": mostly(texts, json_values), "arguments": mostly(texts, json_values), "output": contents,
         "summary": st.lists(mostly(obj({"text": texts}), json_values), max_size=2), "call_id": texts}),
), json_values)
budgets = mostly(st.integers(min_value=-5, max_value=3_000_000), json_values)
common = {
    "model": mostly(texts, json_values), "stream": mostly(st.booleans(), json_values),
    "tools": mostly(st.lists(json_values, max_size=3), json_values),
    "chat_template_kwargs": mostly(obj({}, {"thinking_mode": mostly(st.sampled_from(["enabled", "adaptive",
                                                                                        "disabled"]), json_values)}),
                                   json_values),
    "zzz_unknown": json_values,
}
chat_bodies = obj({"messages": mostly(st.lists(chat_messages, max_size=5), json_values)},
                  {**common, "max_tokens": budgets, "max_completion_tokens": budgets, "documents": json_values})
completion_bodies = obj({"prompt": mostly(st.one_of(texts, st.lists(st.one_of(texts, st.lists(st.integers(), max_size=4)),
                                                                     max_size=3), st.lists(st.integers(), max_size=5)),
                                          json_values)},
                        {**common, "max_tokens": budgets, "suffix": mostly(texts, json_values)})
responses_bodies = obj({"input": mostly(st.one_of(texts, st.lists(response_items, max_size=5)), json_values)},
                       {**common, "max_output_tokens": budgets, "instructions": mostly(texts, json_values),
                        "reasoning": mostly(obj({}, {"effort": mostly(texts, json_values)}), json_values)})
anthropic_bodies = obj({"messages": mostly(st.lists(mostly(obj({"role": mostly(st.sampled_from(["user", "assistant"]),
                                                                                 json_values),
                                                                "content": contents}), json_values), max_size=5),
                                           json_values)},
                       {**common, "max_tokens": budgets, "system": mostly(st.one_of(texts, st.lists(parts, max_size=2)),
                                                                          json_values),
                        "thinking": mostly(obj({"type": mostly(st.sampled_from(["enabled", "disabled", "adaptive"]),
                                                               json_values)}, {"budget_tokens": budgets}),
                                           json_values)})
shaped = st.one_of(
    st.tuples(st.just("chat"), chat_bodies), st.tuples(st.just("completions"), completion_bodies),
    st.tuples(st.just("responses"), responses_bodies), st.tuples(st.just("messages"), anthropic_bodies),
)


def _check(body: Any, api: str, forced: str | None) -> None:
    try:
        profile = classify(body, api, CFG, COUNTER)
    except RequestRejected as exc:
        assert exc.status == 400 and exc.message and isinstance(exc.type, str)
        assert exc.param is None or isinstance(exc.param, str)
        event(f"{api}: rejected {exc.code}")
        return
    assert isinstance(profile, RequestProfile)
    assert profile.prompt_tokens >= 0 and profile.output_budget > 0 and "text" in profile.modalities
    event(f"{api}: profiled" + (" with media" if profile.n_images or profile.n_videos else "")
          + ("" if profile.estimate_exact else " (sampled)"))
    try:
        choice = choose_pool(profile, POOLS, CFG, forced=forced)
    except RequestRejected as exc:
        assert exc.status == 400 and exc.message
        return
    assert choice.pool in choice.candidates and profile.modalities <= set(choice.pool.modalities)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=shaped, forced=st.one_of(st.none(), st.none(), st.sampled_from(["interactive", "extended", "x"])))
def test_shaped_bodies_only_ever_raise_request_rejected(case: tuple[str, Any], forced: str | None) -> None:
    api, body = case
    _check(body, api, forced)


@settings(max_examples=200, deadline=None)
@given(body=json_values, api=st.sampled_from(["chat", "completions", "responses", "messages"]))
def test_arbitrary_json_only_ever_raises_request_rejected(body: Any, api: str) -> None:
    _check(body, api, None)
