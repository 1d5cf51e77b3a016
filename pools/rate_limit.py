"""Per-API-key rate limits (requests/min and tokens/min), shared by every gateway process through Redis.

The algorithm is GCRA (the generic cell rate algorithm, a token bucket stored as one timestamp): a key with a limit
of N per minute may spend N at once, and regains one every 60/N seconds. Each dimension is one Redis string holding
its "theoretical arrival time"; a Lua script checks both dimensions and spends them only if both allow, atomically,
with Redis's own clock (so gateways' clocks need not agree): one EVALSHA per request, nothing else.

When no Redis is configured, or it does not answer within `redis_timeout_s`, the same algorithm runs in this
process's memory: limits then hold per process, not across them (N gateways allow up to N times the limit). The
switch is logged once per outage; Redis is tried again every `redis_retry_s`.

Tokens are counted as OpenAI does: the prompt estimate plus the output budget (max_tokens, or the default reserve),
reserved when the request is admitted and never refunded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pools.shared_state import _redacted  # host:port/db of a Redis URL, never its password

log = logging.getLogger("m3gate.rate_limit")

PERIOD_MS = 60_000  # limits are per minute

# KEYS: requests key, tokens key. ARGV: requests limit, tokens limit (0 = none), token cost, period ms.
# Returns {allowed, wait_ms, req_remaining, req_reset_ms, tok_remaining, tok_reset_ms}.
GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local period = tonumber(ARGV[4])
-- {allowed, wait ms, tat now, tat if spent, interval}
local function gcra(key, limit, cost)
  if limit <= 0 then return {1, 0, now, now, 1} end
  local interval = period / limit
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - period
  if now < allow_at then return {0, allow_at - now, tat, tat, interval} end
  return {1, 0, tat, new_tat, interval}
end
local r = gcra(KEYS[1], tonumber(ARGV[1]), 1)
local k = gcra(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[3]))
local ok = r[1] == 1 and k[1] == 1
local at = ok and 4 or 3  -- what the caller is told: the state after spending, or the unchanged one
if ok then
  if tonumber(ARGV[1]) > 0 then redis.call('SET', KEYS[1], r[4], 'PX', math.ceil(r[4] - now) + 1) end
  if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[2], k[4], 'PX', math.ceil(k[4] - now) + 1) end
end
return {ok and 1 or 0, math.ceil(math.max(r[2], k[2])),
        math.floor((now + period - r[at]) / r[5]), math.ceil(r[at] - now),
        math.floor((now + period - k[at]) / k[5]), math.ceil(k[at] - now)}
"""


@dataclass(frozen=True, slots=True)
class Quota:
    """One dimension after a check: what OpenAI's x-ratelimit-* headers report."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float  # 0 when allowed
    requests: Quota | None
    tokens: Quota | None
    shared: bool  # counted in Redis (across gateways), not in this process only


@dataclass(frozen=True, slots=True)
class Gcra:
    """One GCRA step: allowed or not, the theoretical arrival time (ms) before and after spending, the wait if
    refused."""

    allowed: bool
    tat_ms: float  # before
    new_tat_ms: float  # after spending (== tat_ms when refused)
    interval_ms: float
    wait_ms: float

    def quota(self, limit: int, now_ms: float, spent: bool) -> Quota:
        """Quota left (and time to full) with or without this step's spending, as GCRA_LUA reports it."""
        tat = self.new_tat_ms if spent else self.tat_ms
        return Quota(limit, max(0, math.floor((now_ms + PERIOD_MS - tat) / self.interval_ms)), (tat - now_ms) / 1000)


def gcra(tat_ms: float | None, now_ms: float, limit: int, cost: int, period_ms: float = PERIOD_MS) -> Gcra:
    """The same arithmetic as GCRA_LUA, for the in-memory fallback and for tests."""
    interval = period_ms / limit
    tat = max(tat_ms or now_ms, now_ms)
    new_tat = tat + cost * interval
    allow_at = new_tat - period_ms
    if now_ms < allow_at:
        return Gcra(False, tat, tat, interval, allow_at - now_ms)
    return Gcra(True, tat, new_tat, interval, 0.0)


class RateLimiter:
    """Checks and spends a key's quota: in Redis when it answers, else in memory (see the module doc)."""

    def __init__(
        self, redis_url: str | None, *, prefix: str = "m3gate:rl:", timeout_s: float = 0.25, retry_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self._redis: Any = None
        self._script: Any = None
        self._down_until = 0.0
        self._down = False
        self._memory: dict[str, float] = {}

    async def start(self) -> None:
        if not self.redis_url:
            return
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._redis = aioredis.from_url(
            self.redis_url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        self._script = self._redis.register_script(GCRA_LUA)

    async def stop(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    @property
    def shared(self) -> bool:
        """Whether limits are currently counted in Redis."""
        return self._redis is not None and not self._down

    async def check(self, key_id: str, rpm: int | None, tpm: int | None, tokens: int) -> RateDecision | None:
        """Spend one request and `tokens` tokens of the key's quota if both allow; None when the key has no limits."""
        if not rpm and not tpm:
            return None
        if self._redis is not None and self.clock() >= self._down_until:
            decision = await self._check_redis(key_id, rpm or 0, tpm or 0, tokens)
            if decision is not None:
                return decision
        return self._check_memory(key_id, rpm or 0, tpm or 0, tokens)

    async def _check_redis(self, key_id: str, rpm: int, tpm: int, tokens: int) -> RateDecision | None:
        keys = [f"{self.prefix}{{{key_id}}}:req", f"{self.prefix}{{{key_id}}}:tok"]
        try:
            raw = await asyncio.wait_for(
                self._script(keys=keys, args=[rpm, tpm, tokens, PERIOD_MS]), self.timeout_s * 2
            )
        except Exception as exc:  # noqa: BLE001 - any Redis failure means: count locally for a while
            self._down_until = self.clock() + self.retry_s
            if not self._down:
                self._down = True
                log.warning("rate limits: Redis at %s failed (%s: %s); counting in this process only until it "
                            "answers again (retried every %.1fs)", _redacted(self.redis_url), type(exc).__name__,
                            exc, self.retry_s)
            return None
        if self._down:
            self._down = False
            log.warning("rate limits: Redis at %s answers again; limits are shared across gateways again",
                        _redacted(self.redis_url))
        allowed, wait_ms, req_left, req_reset, tok_left, tok_reset = (int(v) for v in raw)
        return RateDecision(
            allowed=bool(allowed), retry_after_s=wait_ms / 1000,
            requests=Quota(rpm, max(0, req_left), req_reset / 1000) if rpm else None,
            tokens=Quota(tpm, max(0, tok_left), tok_reset / 1000) if tpm else None,
            shared=True,
        )

    def _check_memory(self, key_id: str, rpm: int, tpm: int, tokens: int) -> RateDecision:
        now_ms = self.clock() * 1000
        steps = {}
        for dim, limit, cost in (("req", rpm, 1), ("tok", tpm, tokens)):
            if limit:
                steps[dim] = gcra(self._memory.get(f"{key_id}:{dim}"), now_ms, limit, cost)
        allowed = all(step.allowed for step in steps.values())
        if allowed:
            for dim, step in steps.items():
                self._memory[f"{key_id}:{dim}"] = step.new_tat_ms
        req, tok = steps.get("req"), steps.get("tok")
        return RateDecision(
            allowed=allowed, retry_after_s=max((s.wait_ms for s in steps.values()), default=0.0) / 1000,
            requests=req.quota(rpm, now_ms, allowed) if req else None,
            tokens=tok.quota(tpm, now_ms, allowed) if tok else None,
            shared=False,
        )


def openai_duration(seconds: float) -> str:
    """How OpenAI writes x-ratelimit-reset-*: Go durations such as 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    secs = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{secs}s" if minutes else f"{secs}s"


def rate_limit_headers(decision: RateDecision | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the dimensions the key has."""
    if decision is None:
        return {}
    headers = {}
    for dim, quota in (("requests", decision.requests), ("tokens", decision.tokens)):
        if quota is not None:
            headers[f"x-ratelimit-limit-{dim}"] = str(quota.limit)
            headers[f"x-ratelimit-remaining-{dim}"] = str(quota.remaining)
            headers[f"x-ratelimit-reset-{dim}"] = openai_duration(quota.reset_s)
    return headers
