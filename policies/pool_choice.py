"""Which pool serves a request: the smallest whose context holds it and whose modalities cover it.

Small pools give short requests fast first tokens; big ones are scarce (a 1M-token context holds few sequences), so a
request goes to the smallest pool that can hold its prompt (plus a safety margin for the estimate) and its output
budget. When that pool is saturated it may spill to larger ones, never to smaller ones (they cannot hold it).

Near a limit the estimate is not good enough to decide: when the prompt estimate moved by ±`boundary_band` (combined
with the estimate's own error bound when it was sampled, `RequestProfile.estimate_error`) would land on the other side
of the chosen pool's limit (or of the next smaller pool's), `needs_exact_count` asks the gateway for the model's own
count (a replica's /tokenize); it then calls `choose_pool` again with `with_exact_prompt_tokens`.
Only the prompt is uncertain, so a small prompt with a large max_tokens is never recounted. A request just over the
largest pool is likewise recounted ("near_limit") before it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

from policies.classify import PROMPT_FIELD, RequestProfile
from policies.errors import RequestRejected
from policies.config import ClassificationConfig, PoolConfig

# What the caller can lower when the output budget is what does not fit.
_BUDGET_PARAM = {
    "chat": "max_completion_tokens",
    "completions": "max_tokens",
    "responses": "max_output_tokens",
    "messages": "max_tokens",
}
FORCED_POOL_HEADER = "x-m3gate-pool"
_CONTEXT = attrgetter("max_model_len")
_TEXT_ONLY = frozenset({"text"})


@dataclass(slots=True)
class PoolChoice:
    """The pool to try first, then the larger ones the request may spill to, in order.

    Read-only by convention (change it with `dataclasses.replace`); not frozen because a frozen dataclass is ~4x
    slower to build, and one is built per request."""

    pool: PoolConfig
    candidates: tuple[PoolConfig, ...]
    needs_exact_count: bool
    reason: str  # "fits", "forced", "spill:<saturated pool>", "clamped", "near_limit", "all_saturated"


def with_exact_prompt_tokens(profile: RequestProfile, prompt_tokens: int) -> RequestProfile:
    """The profile re-counted by the model's tokenizer: no safety margin applies and no further count is needed."""
    return replace(profile, prompt_tokens=prompt_tokens, estimate_exact=True, model_counted=True, estimate_error=0.0,
                   estimate_refinable=False)


def with_learned_ratio(profile: RequestProfile, ratio: float) -> RequestProfile:
    """The estimate corrected by what a pool's replicas have been counting for the gateway's estimates
    (policies/estimates.py); a count made by the model's own tokenizer needs no correction."""
    if profile.model_counted or ratio == 1.0:
        return profile
    return profile.with_prompt_tokens(math.ceil(profile.prompt_tokens * ratio))


def after_overlength(
    profile: RequestProfile, pools: Sequence[PoolConfig], refused_by: PoolConfig, counted: int
) -> PoolChoice | None:
    """Where to retry a request whose prompt a replica of `refused_by` found longer than its context (`counted`: the
    tokens it counted, a lower bound; 0 when unknown): the larger pools that take its modalities and hold more than
    that, smallest first. None when there is none (the replica's 400 is then the answer)."""
    larger = tuple(
        p for p in sorted(pools, key=_CONTEXT)
        if p.max_model_len > refused_by.max_model_len and p.max_model_len > counted
        and profile.modalities.issubset(p.modalities)
    )
    if not larger:
        return None
    return PoolChoice(larger[0], larger, False, f"overlength:{refused_by.name}")


def choose_pool(
    profile: RequestProfile,
    pools: Sequence[PoolConfig],
    cfg: ClassificationConfig,
    *,
    forced: str | None = None,
    saturated: frozenset[str] = frozenset(),
) -> PoolChoice:
    """Choose the pool for `profile`, or raise RequestRejected (400) when no pool can serve it."""
    need = _Need(profile, cfg)
    by_size = sorted(pools, key=_CONTEXT)  # callers pass them sorted; a few pools cost nothing
    if forced is not None:
        return _forced(need, by_size, forced)
    modalities = profile.modalities
    if modalities == _TEXT_ONLY:  # every pool accepts text (PoolConfig insists)
        suitable = by_size
    else:
        suitable = [p for p in by_size if modalities.issubset(p.modalities)]
    if not suitable:
        raise _no_modality(profile, by_size)
    largest = suitable[-1]
    first = None
    full = need.full
    for i, p in enumerate(suitable):
        if full <= p.max_model_len:
            first = i
            break
    if first is None:
        if not profile.budget_explicit and need.prompt < largest.max_model_len:
            # No pool holds the default reserve too; vLLM clamps max_tokens to what is left, so serve it.
            near = need.might_not_fit(largest.max_model_len, prompt_only=True)
            return PoolChoice(largest, (largest,), near, "clamped")
        if need.might_fit(largest.max_model_len):
            return PoolChoice(largest, (largest,), True, "near_limit")  # the estimate may be too high: count exactly
        raise _too_long(need, largest)

    chain = [suitable[first]]  # the pools it may overflow into: each spills only if its own config allows
    for pool in suitable[first + 1:]:
        if not chain[-1].spill_upward:
            break
        chain.append(pool)
    at = 0
    if not saturated:
        reason = "fits"
    else:
        while chain[at].name in saturated and chain[at].spill_upward and at + 1 < len(chain):
            at += 1
        if chain[at].name in saturated and at > 0:  # every pool it may spill to is saturated: wait for its own
            at, reason = 0, "all_saturated"
        else:
            reason = "fits" if at == 0 else f"spill:{chain[0].name}"
    chosen = chain[at]
    smaller = suitable[first - 1].max_model_len if first > 0 else None
    needs_exact = need.might_not_fit(chosen.max_model_len) or (smaller is not None and need.might_fit(smaller))
    return PoolChoice(chosen, tuple(chain[at:]), needs_exact, reason)


class _Need:
    """Tokens the request needs from a pool: with the safety margin to decide, and ± the boundary band to tell
    whether an exact count could change the decision (only the prompt is uncertain; the output budget is not)."""

    __slots__ = ("profile", "margin_factor", "prompt", "full", "may_recount", "prompt_high", "full_high", "full_low")

    def __init__(self, profile: RequestProfile, cfg: ClassificationConfig) -> None:
        self.profile = profile
        self.margin_factor = 1.0 if profile.model_counted else 1.0 + cfg.safety_margin
        self.prompt = math.ceil(profile.prompt_tokens * self.margin_factor)
        self.full = self.prompt + profile.output_budget
        self.may_recount = cfg.exact_count_near_boundary and not profile.model_counted
        # A sampled estimate carries its own error bound, independent of the tokenizers' disagreement that the band
        # covers: the two combine in quadrature (10% and 5% make 11.2%). Even the plain band alone recounts every
        # request whose pool an exact count could change while the estimate errs by -6% to +14% (the margin and
        # the band's asymmetry: see test_pool_choice); the widening keeps the band's full slack for the tokenizers.
        error = profile.estimate_error
        band = math.hypot(cfg.boundary_band, error) if error else cfg.boundary_band
        self.prompt_high = math.ceil(profile.prompt_tokens * (1 + band))
        self.full_high = self.prompt_high + profile.output_budget
        self.full_low = math.floor(profile.prompt_tokens * max(0.0, 1 - band)) + profile.output_budget

    def might_not_fit(self, limit: int, prompt_only: bool = False) -> bool:
        """It fits `limit` as estimated, but a prompt a band larger would not: worth an exact count."""
        return self.may_recount and (self.prompt_high >= limit if prompt_only else self.full_high > limit)

    def might_fit(self, limit: int) -> bool:
        """It does not fit `limit` as estimated, but a prompt a band smaller would: worth an exact count."""
        return self.may_recount and self.full_low <= limit

    def fits_forced(self, pool: PoolConfig) -> bool:
        limit = pool.max_model_len
        return (
            self.full <= limit
            or (not self.profile.budget_explicit and self.prompt < limit)
            or self.might_fit(limit)
        )


def _forced(need: _Need, by_size: list[PoolConfig], name: str) -> PoolChoice:
    pool = next((p for p in by_size if p.name == name), None)
    if pool is None:
        names = ", ".join(f"'{p.name}'" for p in by_size)
        raise RequestRejected(
            f"The {FORCED_POOL_HEADER} header names pool '{name}', which does not exist; use one of {names} "
            "or leave the header out to let the gateway choose.",
            param=FORCED_POOL_HEADER,
            code="pool_not_found",
        )
    missing = sorted(need.profile.modalities.difference(pool.modalities))
    if missing:
        raise RequestRejected(
            f"Pool '{pool.name}' (chosen by the {FORCED_POOL_HEADER} header) does not accept {' or '.join(missing)}, "
            f"which this request contains; pick a pool that does or leave the header out.",
            param=FORCED_POOL_HEADER,
            code="unsupported_modality",
        )
    if not need.fits_forced(pool):
        raise _too_long(need, pool, forced=True)
    if need.full <= pool.max_model_len:
        near = need.might_not_fit(pool.max_model_len)
    elif not need.profile.budget_explicit and need.prompt < pool.max_model_len:
        near = need.might_not_fit(pool.max_model_len, prompt_only=True)
    else:  # admitted only because an exact count might fit
        near = True
    return PoolChoice(pool, (pool,), near, "forced")


def _too_long(need: _Need, pool: PoolConfig, forced: bool = False) -> RequestRejected:
    """The 400 for a request no pool can hold: both sizes, the limit, and what to change."""
    profile = need.profile
    limit = pool.max_model_len
    budget = profile.output_budget
    budget_param = profile.budget_field or _BUDGET_PARAM[profile.api]
    if profile.model_counted:
        how = "counted by the model's tokenizer"
    else:
        how = "estimated" if profile.estimate_exact else "estimated from samples"
    budget_from = (
        f"set by {budget_param}" if profile.budget_explicit
        else f"the default reserve for thinking_mode '{profile.thinking_mode}'"
    )
    where = (
        f"pool '{pool.name}' (chosen by the {FORCED_POOL_HEADER} header) holds {limit:,} tokens"
        if forced else f"the largest context available{_for_media(profile)} is {limit:,} tokens (pool '{pool.name}')"
    )
    message = (
        f"This request needs about {profile.prompt_tokens:,} prompt tokens ({how}) plus {budget:,} "
        f"output tokens ({budget_from}), but {where}. "
    )
    if need.prompt >= limit:  # the prompt alone does not fit
        target = math.floor((limit - budget) / need.margin_factor) if budget < limit else 0
        message += f"Shorten the input to under about {target:,} tokens" if target > 0 else "Shorten the input"
        if profile.budget_explicit and budget >= limit:
            message += f" and lower {budget_param} below {limit:,}"
        param = PROMPT_FIELD[profile.api]
    else:  # the explicit output budget is what does not fit
        message += f"Lower {budget_param} to at most {limit - need.prompt:,} or shorten the input"
        param = budget_param
    message += ", or choose a larger pool." if forced else "."
    return RequestRejected(message, param=param, code="context_length_exceeded")


def _for_media(profile: RequestProfile) -> str:
    media = sorted(profile.modalities - {"text"})
    return f" for a request with {' and '.join(media)}" if media else ""


def _no_modality(profile: RequestProfile, by_size: list[PoolConfig]) -> RequestRejected:
    missing = sorted(m for m in profile.modalities if not any(m in p.modalities for p in by_size))
    counts = {"image": profile.n_images, "video": profile.n_videos}
    what = " and ".join(f"{counts.get(m, 0)} {m}(s)" for m in missing) or " and ".join(sorted(profile.modalities))
    offered = "; ".join(f"{p.name}: {', '.join(p.modalities)}" for p in by_size)
    if not missing:  # each modality exists somewhere, but no single pool takes them all
        return RequestRejected(
            f"This request mixes {what}, and no single pool accepts all of them (pools: {offered}). "
            "Send them in separate requests.",
            param=PROMPT_FIELD[profile.api],
            code="unsupported_modality",
        )
    return RequestRejected(
        f"This request contains {what}, but no pool here accepts {' or '.join(missing)} (pools: {offered}). "
        f"Remove the {' and '.join(m + ' parts' for m in missing)} and send text only, "
        "or ask the operator for a pool that lists them in its modalities.",
        param=PROMPT_FIELD[profile.api],
        code="unsupported_modality",
    )
