"""The gateway's token estimates checked against what the replicas counted, and corrected.

Pool choice rests on an estimate (tiktoken × `calibration_factor`; the pool's exact `/tokenize` only near a
boundary). A replica tokenizes with the model's own tokenizer, and for some text (code, CJK, base64, an unusual
vocabulary) that counts far more tokens than the estimate: the request lands in a pool that cannot hold it and vLLM
answers 400. Two corrections live here, both pure:

- `overlength_tokens` reads vLLM's over-length 400 so the coordinator can retry in a larger pool instead of
  returning it (the count vLLM reports is a lower bound: it tokenizes with truncation at max_model_len + 1);
- `TokenEstimateRatios` learns, per pool, actual prompt tokens (`usage.prompt_tokens`) ÷ the estimate, as a bounded
  EWMA, so that after a few answers the estimates, and so the pool choice, are right and the bounces stop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

# vLLM's messages (renderers/params.py `_token_len_check` and the character pre-check), e.g.
# "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, ..."
_CONTAINS_TOKENS = re.compile(r"your prompt contains (?:at least )?(\d+) input tokens")
_MAX_CONTEXT = "maximum context length is"


def overlength_tokens(body: bytes) -> int | None:
    """For a replica's 400 answer: the prompt tokens it counted when it refused the prompt as longer than its
    context (a lower bound), 0 when it refused on characters alone (count unknown), None for any other 400."""
    if b"maximum context length" not in body:
        return None
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    message = error.get("message")
    if not isinstance(message, str) or _MAX_CONTEXT not in message:
        return None
    param = error.get("param")
    if param == "input_text":  # more characters than max_model_len × the longest vocabulary entry
        return 0
    if param not in ("input_tokens", None):
        return None
    found = _CONTAINS_TOKENS.search(message)
    return int(found.group(1)) if found else None


@dataclass(slots=True)
class _Ratio:
    value: float = 1.0
    samples: int = 0


class TokenEstimateRatios:
    """Per pool: actual ÷ estimated prompt tokens, an EWMA bounded to [`low`, `high`], trusted after `min_samples`.

    `ratio(pool)` is what the estimate for that pool should be multiplied by (1.0 until trusted). `observe` returns
    True when the trusted ratio moved by more than `report_change` since it was last reported, so the caller can
    log each real shift once rather than every sample."""

    def __init__(self, alpha: float = 0.3, low: float = 0.5, high: float = 8.0, min_samples: int = 3,
                 report_change: float = 0.1, dead_band: float = 0.05) -> None:
        self.alpha = alpha
        self.low = low
        self.high = high
        self.min_samples = min_samples
        self.report_change = report_change
        self.dead_band = dead_band  # a ratio this close to 1 is within the estimate's margin: not applied
        self._ratios: dict[str, _Ratio] = {}
        self._reported: dict[str, float] = {}

    def ratio(self, pool: str) -> float:
        """What to multiply the pool's estimates by: 1.0 until trusted, and while within `dead_band` of 1 (the
        classification's safety margin and boundary band absorb that much; a correction would only cost a second
        pool choice per request)."""
        entry = self._ratios.get(pool)
        if entry is None or entry.samples < self.min_samples or abs(entry.value - 1.0) <= self.dead_band:
            return 1.0
        return entry.value

    def observe(self, pool: str, estimated: int, actual: int) -> bool:
        """One answer: the replica counted `actual` prompt tokens for a prompt the gateway estimated at
        `estimated` (before any learned correction)."""
        if estimated <= 0 or actual <= 0:
            return False
        sample = min(self.high, max(self.low, actual / estimated))
        entry = self._ratios.get(pool)
        if entry is None:
            entry = self._ratios[pool] = _Ratio(sample, 0)
        else:
            entry.value += self.alpha * (sample - entry.value)
        entry.samples += 1
        if entry.samples < self.min_samples:
            return False
        reported = self._reported.get(pool, 1.0)
        if abs(entry.value - reported) > self.report_change * reported:
            self._reported[pool] = entry.value
            return True
        return False

    def view(self) -> dict[str, float]:
        """Every pool's ratio as used now (1.0 until trusted), for metrics and the admin API."""
        return {pool: self.ratio(pool) for pool in self._ratios}

    def keep_only(self, pools: set[str]) -> None:
        """Forget pools a reload removed."""
        for name in [p for p in self._ratios if p not in pools]:
            del self._ratios[name]
            self._reported.pop(name, None)
