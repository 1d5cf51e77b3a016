"""How many tokens a request will generate, estimated before it runs (`OutputEstimator`).

Where the output length matters before an answer exists (the tokens in flight on a replica, which load scoring reads;
the KV a disaggregated decode replica takes on), the budget (`max_tokens`, else the thinking mode's default reserve)
stood in for it, and an agent turn that answers with a 40-token tool call was counted at its 16K-token reserve. The
estimate instead:

1. a bucket from what the request says (`output_hints`): a forced tool call (`tool_choice` "required", a named
   function, Anthropic's "any" / "tool") → short; thinking enabled → long, sized by its thinking budget when one is
   given; thinking disabled → short with tools, medium without; adaptive → medium. Each bucket stands for a
   representative count (`OutputEstimateConfig`);
2. refined online by the outputs of earlier requests of the same bucket: the session's own recent ones first (a fast
   EWMA, so a session's habits show after a turn or two), else the API key's, else the traffic class's (slower):
   geometric means (an EWMA of the logs), so the long tail of agent outputs does not drag the typical answer's
   estimate up;
3. never above the budget: no answer can be longer.

Pool choice keeps the full budget: a pool must hold prompt + max_tokens whatever the estimate says.

Bounded memory: each scope keeps at most `max_entries` groups (least recently used leaves first) and forgets a group
unseen for `ttl_s`. Pure: no I/O, no clock; the gateway passes the time in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

Bucket = Literal["short", "medium", "long"]
BUCKETS: tuple[Bucket, ...] = ("short", "medium", "long")

# Anthropic's tool_choice types that force a call; OpenAI forces with "required" or a named function (an object)
_FORCED_TYPES = frozenset({"any", "tool", "function"})


class OutputHints(NamedTuple):
    """What a request says about its output's length (a NamedTuple: built once per request, ~4× cheaper than a
    frozen dataclass)."""

    thinking_mode: str  # enabled | adaptive | disabled
    budget: int  # the most tokens it may generate (max_tokens, else the mode's default reserve)
    thinking_budget: int | None = None  # thinking.budget_tokens / chat_template_kwargs.thinking_budget (enabled)
    tools: bool = False  # it offers tools the model may call (tool_choice other than "none")
    forced_tool: bool = False  # tool_choice makes the model call one

    @property
    def prior(self) -> Bucket:
        """The bucket the request's own fields point to."""
        if self.forced_tool:
            return "short"
        if self.thinking_mode == "enabled":
            return "long"
        if self.thinking_mode == "disabled":
            return "short" if self.tools else "medium"
        return "medium"


def output_hints(body: dict[str, Any], thinking_mode: str, budget: int) -> OutputHints:
    """The hints of a parsed, already validated request body (any API). Never raises: an odd field is no hint."""
    tools = forced = False
    if body.get("tools"):
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else choice
        tools = kind != "none"
        forced = kind == "required" or (kind in _FORCED_TYPES and isinstance(choice, dict))
    thinking = None if thinking_mode != "enabled" else _thinking_budget(body)
    return OutputHints(thinking_mode, budget, thinking, tools, forced)


def _thinking_budget(body: dict[str, Any]) -> int | None:
    """Anthropic's `thinking.budget_tokens`, else `chat_template_kwargs.thinking_budget` (a positive integer)."""
    for holder, name in ((body.get("thinking"), "budget_tokens"), (body.get("chat_template_kwargs"), "thinking_budget")):
        value = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class OutputEstimate(NamedTuple):
    """A request's predicted output: its tokens, their bucket, and what the figure rests on."""

    tokens: int
    bucket: Bucket
    source: str  # prior | session | key | class


@dataclass(slots=True)
class _Mean:
    log: float  # EWMA of log(output tokens)
    samples: int
    seen: float  # when it last learnt (seconds)


class _Scope:
    """One scope's groups (session, key or class × prior bucket): EWMA of the log outputs, LRU-bounded, expiring."""

    __slots__ = ("alpha", "min_samples", "ttl_s", "max_entries", "_means")

    def __init__(self, alpha: float, min_samples: int, ttl_s: float, max_entries: int) -> None:
        self.alpha, self.min_samples, self.ttl_s, self.max_entries = alpha, min_samples, ttl_s, max_entries
        self._means: OrderedDict[tuple[str, str], _Mean] = OrderedDict()

    def get(self, key: tuple[str, str], now: float) -> float | None:
        """The group's log mean, once trusted and not expired."""
        mean = self._means.get(key)
        if mean is None or mean.samples < self.min_samples:
            return None
        if now - mean.seen > self.ttl_s:
            del self._means[key]
            return None
        return mean.log

    def learn(self, key: tuple[str, str], log_tokens: float, now: float) -> None:
        means = self._means
        mean = means.get(key)
        if mean is None or now - mean.seen > self.ttl_s:
            means[key] = _Mean(log_tokens, 1, now)
            means.move_to_end(key)
            while len(means) > self.max_entries:
                means.popitem(last=False)
            return
        mean.log += self.alpha * (log_tokens - mean.log)
        mean.samples += 1
        mean.seen = now
        means.move_to_end(key)

    def __len__(self) -> int:
        return len(self._means)


class OutputEstimator:
    """Output-length estimates per request, learnt from finished ones (see the module's docstring).

    `bucket_tokens`: each bucket's representative count (the prior), ascending; a count is in the bucket whose
    representative is nearest in log scale (boundaries at the geometric midpoints)."""

    def __init__(self, bucket_tokens: tuple[int, int, int] = (128, 512, 2048), *, session_alpha: float = 0.3,
                 alpha: float = 0.1, min_samples: int = 3, ttl_s: float = 1800.0, max_sessions: int = 10_000,
                 max_keys: int = 1_000) -> None:
        self.bucket_tokens = bucket_tokens
        short, medium, long = bucket_tokens
        self.bounds = (math.sqrt(short * medium), math.sqrt(medium * long))
        self.sessions = _Scope(session_alpha, 1, ttl_s, max_sessions)
        self.keys = _Scope(alpha, min_samples, ttl_s, max_keys)
        self.classes = _Scope(alpha, min_samples, ttl_s, max_keys)

    def bucket(self, tokens: float) -> Bucket:
        low, high = self.bounds
        return "short" if tokens < low else "medium" if tokens < high else "long"

    def prior_tokens(self, hints: OutputHints) -> int:
        """The bucket's representative count; thinking enabled with a budget: that budget plus a short answer (the
        model rarely thinks to the last token, nor stops far short of a budget it was given)."""
        prior = hints.prior
        if prior == "long" and hints.thinking_budget is not None:
            return hints.thinking_budget + self.bucket_tokens[0]
        return self.bucket_tokens[BUCKETS.index(prior)]

    def estimate(self, hints: OutputHints, now: float, session: str = "", key: str = "", cls: str = "") -> OutputEstimate:
        """The request's output estimate at `now` (seconds): refined by its session's, else its key's, else its
        class's recent outputs of the same prior bucket; at least 1, at most the budget."""
        prior = hints.prior
        logged, source = None, "prior"
        if session:
            logged, source = self.sessions.get((session, prior), now), "session"
        if logged is None and key:
            logged, source = self.keys.get((key, prior), now), "key"
        if logged is None and cls:
            logged, source = self.classes.get((cls, prior), now), "class"
        if logged is None:
            tokens, source = self.prior_tokens(hints), "prior"
        else:
            tokens = round(math.exp(logged))
        tokens = max(1, min(hints.budget, tokens))
        return OutputEstimate(tokens, self.bucket(tokens), source)

    def observe(self, hints: OutputHints, completion_tokens: int, now: float, session: str = "", key: str = "",
                cls: str = "") -> None:
        """A request with these hints generated `completion_tokens` (its answer's usage), finished at `now`."""
        if completion_tokens <= 0:
            return
        prior, sample = hints.prior, math.log(completion_tokens)
        for scope, name in ((self.sessions, session), (self.keys, key), (self.classes, cls)):
            if name:
                scope.learn((name, prior), sample, now)

    def view(self) -> dict[str, int]:
        """How many groups each scope holds (each bounded by construction)."""
        return {"sessions": len(self.sessions), "keys": len(self.keys), "classes": len(self.classes)}
