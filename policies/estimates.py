"""The gateway's token estimates checked against what the replicas counted, and corrected.

Pool choice rests on an estimate (tiktoken × `calibration_factor`; the pool's exact `/tokenize` only near a
boundary). A replica tokenizes with the model's own tokenizer, and for some text (code, CJK, base64, an unusual
vocabulary) that counts far more tokens than the estimate: the request lands in a pool that cannot hold it and vLLM
answers 400. Two corrections live here, both pure:

- `overlength_tokens` reads vLLM's over-length 400 so the coordinator can retry in a larger pool instead of
  returning it (the count vLLM reports is a lower bound: it tokenizes with truncation at max_model_len + 1);
- `TokenEstimateRatios` learns, per pool, actual prompt tokens (`usage.prompt_tokens`) ÷ the estimate, as the
  winsorized mean of the log ratios over a bounded window, so that after a few answers the estimates, and so the
  pool choice, are right and the bounces stop. A robust statistic, not an EWMA: benchmark tools mix unusual prompts
  (code, CJK, random tokens) whose ratios lie far from the pool's typical one, and an EWMA follows each of them
  (0.55× ↔ 1.39× within seconds); the winsorized mean of the last 512 samples clips a fifth of them on either side
  and moves only when the pool's traffic does.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field

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
    logs: deque[float]  # the last `window` samples' log ratios
    value: float = 1.0  # the robust ratio over them
    samples: int = 0
    reported: float = 1.0  # the value last logged (1.0: the estimate itself)
    reported_at: float | None = None  # when it was logged
    sorted_logs: list[float] = field(default_factory=list)


def winsorized_mean(values: list[float], trim: float) -> float:
    """The mean of sorted `values` with the lowest and highest `trim` share (at least one each from three values on)
    raised or lowered to the nearest kept value: that share on either side can be anything without moving it more
    than to the edge of the rest, and a traffic mix of two kinds of prompt averages steadily (a trimmed mean or a
    median jumps between the kinds as their counts in the window shift)."""
    n = len(values)
    cut = min((n - 1) // 2, math.ceil(n * trim))
    if cut == 0:
        return sum(values) / n
    return (cut * values[cut] + sum(values[cut:n - cut]) + cut * values[n - 1 - cut]) / n


class TokenEstimateRatios:
    """Per pool: actual ÷ estimated prompt tokens, the `trim`-winsorized mean of the last `window` samples' logs
    (each bounded to [`low`, `high`]), trusted after `min_samples`.

    `ratio(pool)` is what the estimate for that pool should be multiplied by (1.0 until trusted). `observe` returns
    True when the trusted ratio is worth a log line: more than `report_change` from the value last reported, and
    `report_interval` seconds since that report (per pool), so a drifting ratio is logged once a minute at most."""

    def __init__(self, low: float = 0.5, high: float = 8.0, min_samples: int = 3, window: int = 512,
                 trim: float = 0.2, report_change: float = 0.1, report_interval: float = 60.0,
                 dead_band: float = 0.05) -> None:
        self.low = low
        self.high = high
        self.min_samples = min_samples
        self.window = window
        self.trim = trim
        self.report_change = report_change
        self.report_interval = report_interval
        self.dead_band = dead_band  # a ratio this close to 1 is within the estimate's margin: not applied
        self._ratios: dict[str, _Ratio] = {}

    def ratio(self, pool: str) -> float:
        """What to multiply the pool's estimates by: 1.0 until trusted, and while within `dead_band` of 1 (the
        classification's safety margin and boundary band absorb that much; a correction would only cost a second
        pool choice per request)."""
        entry = self._ratios.get(pool)
        if entry is None or entry.samples < self.min_samples or abs(entry.value - 1.0) <= self.dead_band:
            return 1.0
        return entry.value

    def observe(self, pool: str, estimated: int, actual: int, now: float, at_least: bool = False) -> bool:
        """One answer at time `now` (seconds): the replica counted `actual` prompt tokens for a prompt the gateway
        estimated at `estimated` (before any learned correction); `at_least`: `actual` is a lower bound (vLLM's
        over-length 400 counts a truncated prompt), so it can only raise the ratio. True: log the pool's ratio now."""
        if estimated <= 0 or actual <= 0:
            return False
        entry = self._ratios.get(pool)
        if entry is None:
            entry = self._ratios[pool] = _Ratio(deque(maxlen=self.window))
        ratio = min(self.high, max(self.low, actual / estimated))
        if at_least and entry.logs:
            ratio = max(ratio, entry.value)
        _record(entry, math.log(ratio), self.trim)
        if entry.samples < self.min_samples or abs(self.ratio(pool) - entry.reported) <= \
                self.report_change * entry.reported:
            return False
        if entry.reported_at is not None and now - entry.reported_at < self.report_interval:
            return False
        entry.reported, entry.reported_at = self.ratio(pool), now
        return True

    def view(self) -> dict[str, float]:
        """Every pool's ratio as used now (1.0 until trusted), for metrics and the admin API."""
        return {pool: self.ratio(pool) for pool in self._ratios}

    def keep_only(self, pools: set[str]) -> None:
        """Forget pools a reload removed."""
        for name in [p for p in self._ratios if p not in pools]:
            del self._ratios[name]



def _record(entry: _Ratio, sample: float, trim: float) -> None:
    """Add one log ratio to the pool's window (the oldest leaves a full one) and recompute the robust value."""
    if len(entry.logs) == entry.logs.maxlen:  # the oldest leaves: found by bisection (list.remove scans)
        sorted_logs = entry.sorted_logs
        del sorted_logs[bisect_left(sorted_logs, entry.logs[0])]
    entry.logs.append(sample)
    insort(entry.sorted_logs, sample)
    entry.value = math.exp(winsorized_mean(entry.sorted_logs, trim))
    entry.samples += 1
