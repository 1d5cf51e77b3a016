"""Traffic classes (from header, key or pool), priorities, per-key pools, and input limits (policies/traffic.py)."""

from __future__ import annotations

from typing import Any

import pytest

from policies.errors import RequestRejected
from policies.pool_choice import PoolChoice
from policies.traffic import check_input_limits, pool_class, request_priority, resolve_class, restrict_to_key
from policies.config import ApiKeyConfig, InputLimitsConfig, PoolConfig, TrafficClassConfig, TrafficConfig

SMALL = PoolConfig(name="small", max_model_len=32_768)
MEDIUM = PoolConfig(name="medium", max_model_len=131_072)
LARGE = PoolConfig(name="large", max_model_len=1_048_576)
BY_SIZE = [SMALL, MEDIUM, LARGE]
TRAFFIC = TrafficConfig()  # interactive 0, repository 1, extended 2
HASH = "a" * 64


def _key(**kw: Any) -> ApiKeyConfig:
    return ApiKeyConfig(name="alice", key_sha256=HASH, **kw)


def test_default_class_is_the_pool_of_the_same_name_else_by_size_rank() -> None:
    named = [PoolConfig(name="interactive", max_model_len=8192), PoolConfig(name="repository", max_model_len=65536)]
    assert pool_class(TRAFFIC, named, "repository") == "repository"
    assert [pool_class(TRAFFIC, BY_SIZE, p.name) for p in BY_SIZE] == ["interactive", "repository", "extended"]
    two_classes = TrafficConfig(classes={"fast": TrafficClassConfig(priority=0),
                                         "bulk": TrafficClassConfig(priority=9)})
    assert [pool_class(two_classes, BY_SIZE, p.name) for p in BY_SIZE] == ["fast", "bulk", "bulk"]
    mapped = TrafficConfig(pool_classes={"large": "interactive"})
    assert pool_class(mapped, BY_SIZE, "large") == "interactive"


def test_class_comes_from_the_header_if_the_key_allows_it_else_the_key_else_the_pool() -> None:
    assert resolve_class(TRAFFIC, BY_SIZE, "medium", None, None) == "repository"
    assert resolve_class(TRAFFIC, BY_SIZE, "medium", None, _key(traffic_class="extended")) == "extended"
    allowed = _key(allowed_classes=["interactive"])
    assert resolve_class(TRAFFIC, BY_SIZE, "medium", "interactive", allowed) == "interactive"
    assert resolve_class(TRAFFIC, BY_SIZE, "medium", "interactive", None) == "interactive"  # open gateway
    with pytest.raises(RequestRejected) as denied:
        resolve_class(TRAFFIC, BY_SIZE, "medium", "interactive", _key(traffic_class="repository"))
    assert denied.value.status == 403 and denied.value.code == "traffic_class_not_allowed"
    assert "'repository'" in denied.value.message and "x-m3gate-class" in denied.value.message
    with pytest.raises(RequestRejected) as unknown:
        resolve_class(TRAFFIC, BY_SIZE, "medium", "vip", allowed)
    assert unknown.value.status == 400 and unknown.value.param == "x-m3gate-class"
    assert "'extended', 'interactive', 'repository'" in unknown.value.message


def test_disabled_thinking_gets_the_latency_class_priority() -> None:
    assert request_priority(TRAFFIC, "repository", "enabled") == 1
    assert request_priority(TRAFFIC, "repository", "disabled") == 0
    off = TrafficConfig(latency_sensitive_disabled_thinking=False)
    assert request_priority(off, "repository", "disabled") == 1
    chosen = TrafficConfig(latency_class="repository")
    assert request_priority(chosen, "extended", "disabled") == 1


def test_a_key_only_reaches_its_pools() -> None:
    choice = PoolChoice(SMALL, (SMALL, MEDIUM, LARGE), False, "fits")
    assert restrict_to_key(choice, None, False) is choice
    assert restrict_to_key(choice, _key(), False) is choice
    narrowed = restrict_to_key(choice, _key(pools=["medium", "large"]), False)
    assert narrowed.pool == MEDIUM and narrowed.candidates == (MEDIUM, LARGE)
    with pytest.raises(RequestRejected) as denied:
        restrict_to_key(PoolChoice(LARGE, (LARGE,), False, "forced"), _key(pools=["small"]), True)
    assert denied.value.status == 403 and denied.value.code == "pool_not_allowed"
    assert denied.value.param == "x-m3gate-pool" and "'small'" in denied.value.message


LIMITS = InputLimitsConfig(max_messages=3, max_images=2, max_image_data_url_bytes=100)


def _msg(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def _img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_input_limits_refuse_too_many_messages() -> None:
    check_input_limits({"messages": [_msg()] * 3}, "chat", LIMITS)
    with pytest.raises(RequestRejected) as refused:
        check_input_limits({"messages": [_msg()] * 4}, "chat", LIMITS)
    assert refused.value.status == 400 and refused.value.param == "messages" and "at most 3" in refused.value.message
    with pytest.raises(RequestRejected) as responses:
        check_input_limits({"input": [{"role": "user", "content": "x"}] * 4}, "responses", LIMITS)
    assert responses.value.param == "input"


def test_input_limits_count_images_across_messages_and_nested_tool_results() -> None:
    small = "data:image/png;base64," + "A" * 20
    check_input_limits({"messages": [_msg(_img(small)), _msg(_img("https://x/y.png"))]}, "chat", LIMITS)
    with pytest.raises(RequestRejected) as refused:
        check_input_limits({"messages": [_msg(_img(small), _img(small)), _msg(_img(small))]}, "chat", LIMITS)
    assert refused.value.code == "too_many_images"
    anthropic = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 20}}
    nested = {"type": "tool_result", "tool_use_id": "t", "content": [anthropic, anthropic, anthropic]}
    with pytest.raises(RequestRejected):
        check_input_limits({"messages": [_msg(nested)]}, "messages", LIMITS)


def test_input_limits_refuse_an_oversized_inline_image_but_not_a_url() -> None:
    check_input_limits({"messages": [_msg(_img("https://example.com/" + "x" * 500))]}, "chat", LIMITS)
    with pytest.raises(RequestRejected) as refused:
        big = _img("data:image/png;base64," + "A" * 200)
        check_input_limits({"messages": [_msg({"type": "text", "text": "see"}, big)]}, "chat", LIMITS)
    assert refused.value.status == 413 and refused.value.code == "image_too_large"
    assert refused.value.param == "messages[0].content[1]"
    with pytest.raises(RequestRejected):
        check_input_limits({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 200}]}]}, "responses", LIMITS)


def test_input_limits_ignore_shapes_the_classifier_reports() -> None:
    check_input_limits({"messages": "not a list"}, "chat", LIMITS)
    check_input_limits({"prompt": ["a"] * 10}, "completions", LIMITS)
    check_input_limits({"messages": [1, None, {"content": [None, 3]}]}, "chat", LIMITS)
