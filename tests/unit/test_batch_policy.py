"""policies/batch.py: each input line is checked with its line number, groups follow the shared prefix, jobs run
earliest deadline first, and output lines have OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from policies.batch import (
    BatchLine,
    JobDeadline,
    LineError,
    check_line,
    check_window,
    dispatch_order,
    failed_line,
    finish_estimate,
    lines_to_send,
    output_line,
    prefix_group,
    window_seconds,
)
from policies.errors import RequestRejected

SERVED = frozenset({"m3", "m3-alias"})
URL = "/v1/chat/completions"


def _raw(**over: Any) -> bytes:
    item = {"custom_id": "a", "method": "POST", "url": URL,
            "body": {"model": "m3", "messages": [{"role": "user", "content": "hi"}]}}
    item.update(over)
    return json.dumps(item).encode()


def _check(raw: bytes, max_body: int = 10_000) -> BatchLine | LineError:
    return check_line(7, raw, URL, SERVED, max_body)


def test_a_valid_line_gives_its_custom_id_and_group() -> None:
    checked = _check(_raw())
    assert isinstance(checked, BatchLine) and checked.custom_id == "a"


@pytest.mark.parametrize(("raw", "code", "param"), [
    (b"{oops", "invalid_json_line", None),
    (b"[1, 2]", "invalid_json_line", None),
    (_raw(custom_id=""), "missing_required_parameter", "custom_id"),
    (_raw(method="GET"), "invalid_method", "method"),
    (_raw(url="/v1/completions"), "mismatched_url", "url"),
    (_raw(body="text"), "missing_required_parameter", "body"),
    (_raw(body={"model": "gpt-4o", "messages": []}), "model_not_found", "body.model"),
    (_raw(body={"model": "m3", "messages": [], "stream": True}), "invalid_value", "body.stream"),
])
def test_each_bad_line_names_its_line_code_and_param(raw: bytes, code: str, param: str | None) -> None:
    checked = _check(raw)
    assert isinstance(checked, LineError)
    assert (checked.line, checked.code, checked.param) == (7, code, param)
    assert checked.to_openai()["line"] == 7


def test_a_body_over_the_request_limit_is_refused_with_the_limit() -> None:
    raw = _raw(body={"model": "m3", "messages": [{"role": "user", "content": "x" * 500}]})
    checked = _check(raw, max_body=400)
    assert isinstance(checked, LineError) and checked.code == "request_too_large" and "400" in checked.message
    assert isinstance(_check(raw, max_body=600), BatchLine)


def test_an_alias_and_a_missing_model_are_served() -> None:
    assert isinstance(_check(_raw(body={"model": "m3-alias", "messages": []})), BatchLine)
    assert isinstance(_check(_raw(body={"messages": []})), BatchLine)


def test_lines_sharing_a_system_prompt_share_a_group() -> None:
    def chat(system: str, user: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    assert prefix_group(chat("S1", "a")) == prefix_group(chat("S1", "b"))
    assert prefix_group(chat("S1", "a")) != prefix_group(chat("S2", "a"))
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert prefix_group({**chat("S1", "a"), "tools": tools}) != prefix_group(chat("S1", "a"))
    assert prefix_group({"prompt": "same start " * 40 + "x"}) == prefix_group({"prompt": "same start " * 40 + "y"})
    assert prefix_group({"instructions": "I", "input": "a"}) == prefix_group({"instructions": "I", "input": "b"})


def test_jobs_run_earliest_deadline_first() -> None:
    jobs = [JobDeadline("b", 300.0), JobDeadline("a", 100.0), JobDeadline("c", 200.0)]
    assert dispatch_order(jobs) == ["a", "c", "b"]


def test_windows() -> None:
    assert window_seconds("24h") == 86_400 and window_seconds("90m") == 5_400 and window_seconds("2d") == 172_800
    assert check_window("24h", ["24h"]) == 86_400
    with pytest.raises(RequestRejected) as refused:
        check_window("1h", ["24h"])
    assert refused.value.param == "completion_window" and refused.value.status == 400


def test_output_and_error_lines_have_openais_shape() -> None:
    out = json.loads(output_line("batch_req_1", "a", 200, "req-9", {"choices": []}))
    assert out == {"id": "batch_req_1", "custom_id": "a", "error": None,
                   "response": {"status_code": 200, "request_id": "req-9", "body": {"choices": []}}}
    err = json.loads(failed_line("batch_req_2", "b", "batch_expired", "late"))
    assert err == {"id": "batch_req_2", "custom_id": "b", "response": None,
                   "error": {"code": "batch_expired", "message": "late"}}


def test_the_predicted_finish_follows_the_recent_rate() -> None:
    assert finish_estimate([], 100) == (0.0, None)
    assert finish_estimate([(10.0, 0)], 100) == (0.0, None)
    rate, finish = finish_estimate([(10.0, 0), (20.0, 50)], 100)
    assert rate == 5.0 and finish == 30.0
    assert finish_estimate([(10.0, 5), (20.0, 5)], 100) == (0.0, None)  # stalled: no prediction


def test_a_cold_group_sends_its_leader_alone_then_the_rest() -> None:
    pending = [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b")]
    assert lines_to_send(pending, [], set(), free=10) == [1, 4]  # one leader per cold group
    assert lines_to_send(pending[1:], ["a"], set(), free=10) == [4]  # a's leader still runs
    assert lines_to_send(pending[1:], ["a"], {"a"}, free=10) == [2, 3, 4]  # a answered: cached now
    assert lines_to_send(pending, [], {"a", "b"}, free=3) == [1, 2, 3]  # never more than the free slots
