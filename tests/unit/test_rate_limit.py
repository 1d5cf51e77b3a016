"""Rate limits: GCRA arithmetic on a fake clock, the Lua script agreeing with it on the real Redis (db 8), the
in-memory fallback (logged once), and OpenAI's x-ratelimit-* headers."""

from __future__ import annotations

import logging
import math
import socket
import time
import uuid

import pytest

from pools.rate_limit import Quota, RateDecision, RateLimiter, gcra, openai_duration, rate_limit_headers

REDIS = "redis://127.0.0.1:6379/8"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_gcra_allows_a_minute_of_quota_at_once_then_one_per_interval() -> None:
    tat = None
    now = 0.0
    for i in range(6):  # 6 per minute: all 6 at once
        step = gcra(tat, now, limit=6, cost=1)
        assert step.allowed and step.quota(6, now, spent=True).remaining == 5 - i
        tat = step.new_tat_ms
    refused = gcra(tat, now, limit=6, cost=1)
    assert not refused.allowed and refused.wait_ms == pytest.approx(10_000)
    assert refused.new_tat_ms == tat  # a refusal spends nothing
    assert refused.quota(6, now, spent=False).reset_s == pytest.approx(60)
    assert gcra(tat, 10_000, limit=6, cost=1).allowed  # one regained after 60/6 s


def test_gcra_counts_tokens_by_cost() -> None:
    step = gcra(None, 0, limit=1000, cost=700)
    assert step.allowed and step.quota(1000, 0, spent=True).remaining == 300
    refused = gcra(step.new_tat_ms, 0, limit=1000, cost=400)
    assert not refused.allowed and refused.quota(1000, 0, spent=False).remaining == 300
    assert refused.wait_ms == pytest.approx(6_000)  # 100 tokens short at 1000/min


async def test_memory_limits_spend_both_dimensions_or_neither() -> None:
    clock = FakeClock()
    rl = RateLimiter(None, clock=clock)
    assert await rl.check("k", None, None, 10) is None  # no limits: nothing to count
    first = await rl.check("k", 10, 1000, 600)
    assert first is not None and first.allowed and not first.shared
    assert first.requests is not None and first.requests.remaining == 9
    assert first.tokens is not None and first.tokens.remaining == 400
    refused = await rl.check("k", 10, 1000, 600)  # tokens do not allow it
    assert refused is not None and not refused.allowed
    assert refused.requests is not None and refused.requests.remaining == 9  # the request was not spent either
    assert refused.retry_after_s == pytest.approx(12.0)
    clock.now += 12
    again = await rl.check("k", 10, 1000, 600)
    assert again is not None and again.allowed
    other = await rl.check("other", 10, 1000, 600)  # keys do not share quota
    assert other is not None and other.allowed


async def test_the_lua_script_agrees_with_the_python_arithmetic_on_real_redis() -> None:
    rl = RateLimiter(REDIS, prefix=f"m3gate-test:{uuid.uuid4().hex}:")
    await rl.start()
    try:
        started = time.monotonic()
        decisions = [await rl.check("k", 5, 10_000, 1500) for _ in range(7)]
        elapsed = time.monotonic() - started
    finally:
        await rl.stop()
    assert all(d is not None and d.shared for d in decisions)
    allowed = [d.allowed for d in decisions if d is not None]
    assert allowed == [True] * 5 + [False] * 2
    last = decisions[-1]
    assert last is not None and last.requests is not None and last.tokens is not None
    assert last.requests.remaining == 0
    # 5 × 1500 spent; tokens flow back at 10,000 per 60 s while the calls run (tens of ms on a loaded machine)
    assert 10_000 - 5 * 1500 <= last.tokens.remaining <= 10_000 - 5 * 1500 + math.ceil(elapsed * 10_000 / 60)
    assert 11.0 < last.retry_after_s <= 12.0  # a request slot every 12 s
    assert 59.0 < last.requests.reset_s <= 60.0


async def test_unreachable_redis_falls_back_to_memory_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clock = FakeClock()
    rl = RateLimiter(f"redis://127.0.0.1:{port}/8", retry_s=5, clock=clock)
    await rl.start()
    try:
        with caplog.at_level(logging.WARNING, logger="m3gate.rate_limit"):
            decisions = [await rl.check("k", 2, None, 1) for _ in range(3)]
            clock.now += 31  # a slot is regained; Redis is retried (and fails again): still one warning per outage
            decisions.append(await rl.check("k", 2, None, 1))
    finally:
        await rl.stop()
    assert [d.allowed for d in decisions if d is not None] == [True, True, False, True]
    assert not any(d.shared for d in decisions if d is not None)
    assert len([r for r in caplog.records if "counting in this process only" in r.getMessage()]) == 1


def test_headers_are_openais() -> None:
    decision = RateDecision(True, 0.0, Quota(60, 59, 1.0), Quota(90_000, 88_500, 1.0), True)
    assert rate_limit_headers(decision) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "90000", "x-ratelimit-remaining-tokens": "88500", "x-ratelimit-reset-tokens": "1s",
    }
    assert rate_limit_headers(RateDecision(True, 0.0, Quota(60, 59, 1.0), None, True)).keys() == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"}
    assert rate_limit_headers(None) == {}
    assert [openai_duration(s) for s in (0.02, 1, 17.5, 360, 61.25)] == ["20ms", "1s", "17.5s", "6m0s", "1m1.25s"]
