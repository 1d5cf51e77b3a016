"""The Batch API's decisions, pure: whether an input line is valid (with its line number), the prefix group a line
is dispatched with, the order jobs are served in, a completion window's length, and the exact output and error
lines OpenAI (and `vllm run-batch`) write. No I/O: the store and the runner (gateway/batch/) call these."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import orjson

from policies.errors import RequestRejected

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
# statuses a runner still has work for; the rest are final
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
RETRY_STATUSES = frozenset({429, 503})  # admission refused (queue full, saturated, rate limit): run the line later
MAX_LINE_ERRORS = 100  # a batch that fails validation lists at most this many lines


class LineError(NamedTuple):
    """One entry of a failed batch's `errors.data` (OpenAI's shape)."""

    line: int
    code: str
    message: str
    param: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


class BatchLine(NamedTuple):
    """A valid input line: what the runner needs to dispatch it (the body is read again from the file then)."""

    custom_id: str
    group: str  # prefix group: lines sharing a system prompt / tool schemas / instructions run together


def window_seconds(window: str) -> float:
    """`24h` → 86400.0 (the config validates the form)."""
    return float(int(window[:-1]) * _UNITS[window[-1]])


def check_window(window: Any, allowed: Sequence[str]) -> float:
    if not isinstance(window, str) or window not in allowed:
        raise RequestRejected(f"completion_window must be one of {', '.join(allowed)}; got {window!r}.",
                              param="completion_window", code="invalid_value")
    return window_seconds(window)


def check_endpoint(endpoint: Any) -> str:
    if endpoint not in BATCH_ENDPOINTS:
        raise RequestRejected(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}; got {endpoint!r}.",
                              param="endpoint", code="invalid_value")
    return str(endpoint)


def check_line(line_no: int, raw: bytes, endpoint: str, served: frozenset[str], max_body_bytes: int) -> \
        BatchLine | LineError:
    """One input line (1-based `line_no`): `{"custom_id", "method": "POST", "url", "body"}`, its url the batch's
    endpoint, its model served here, its body within the request limit and not streamed."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return LineError(line_no, "invalid_json_line", f"Line {line_no} is not valid JSON: {exc}")
    if not isinstance(item, dict):
        return LineError(line_no, "invalid_json_line", f"Line {line_no} must be a JSON object.")
    custom_id, body = item.get("custom_id"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, "missing_required_parameter", "`custom_id` must be a non-empty string.",
                         "custom_id")
    if item.get("method") != "POST":
        return LineError(line_no, "invalid_method", f"`method` must be POST; got {item.get('method')!r}.", "method")
    if item.get("url") != endpoint:
        return LineError(line_no, "mismatched_url", f"`url` is {item.get('url')!r}, but the batch's endpoint is "
                         f"{endpoint}; every line must use the batch's endpoint.", "url")
    if not isinstance(body, dict):
        return LineError(line_no, "missing_required_parameter", "`body` must be a JSON object.", "body")
    return _check_body(line_no, custom_id, body, served, max_body_bytes)


def _check_body(line_no: int, custom_id: str, body: dict[str, Any], served: frozenset[str],
                max_body_bytes: int) -> BatchLine | LineError:
    model = body.get("model")
    if model is not None and model not in served:
        return LineError(line_no, "model_not_found", f"The model {model!r} is not served here; this gateway "
                         f"serves: {', '.join(sorted(served))}.", "body.model")
    if body.get("stream"):
        return LineError(line_no, "invalid_value", "Batch requests cannot stream; leave `stream` out.", "body.stream")
    size = len(orjson.dumps(body))
    if size > max_body_bytes:
        return LineError(line_no, "request_too_large", f"The body is {size:,} bytes; this gateway accepts at most "
                         f"{max_body_bytes:,} bytes per request.", "body")
    return BatchLine(custom_id, prefix_group(body))


def duplicate_error(line_no: int, custom_id: str) -> LineError:
    return LineError(line_no, "duplicate_custom_id", f"The custom_id {custom_id!r} appears on an earlier line; "
                     "every line needs its own custom_id.", "custom_id")


def prefix_group(body: dict[str, Any]) -> str:
    """A short hash of what requests of one job typically share at the front of their prompts: system / developer
    messages, tool schemas, `instructions`, else the start of the prompt. Lines with one group run one after another,
    so the replica that cached the prefix for the first serves the rest from cache."""
    shared: list[Any] = [body.get("tools"), body.get("instructions")]
    messages = body.get("messages") or (body.get("input") if isinstance(body.get("input"), list) else None)
    if isinstance(messages, list):
        shared += [m for m in messages[:4] if isinstance(m, dict) and m.get("role") in ("system", "developer")]
    if not any(shared):
        prompt = body.get("prompt") or body.get("input") or ""
        shared.append(prompt[:256] if isinstance(prompt, str) else "")
    return hashlib.blake2b(orjson.dumps(shared, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()


def lines_to_send(pending: Iterable[tuple[int, str]], in_flight: Iterable[str], warm: set[str], free: int) -> \
        list[int]:
    """Which pending lines (line number, prefix group; in dispatch order, none in flight) to send now, at most
    `free`. A group whose prefix is not cached yet sends one line, its leader, and the rest only once an answer has
    come back (`warm`): sent together, they would all compute the same prefix at once, since a replica caches a
    prefix only after computing it."""
    leading = {group for group in in_flight if group not in warm}
    out: list[int] = []
    for line_no, group in pending:
        if len(out) >= free:
            break
        if group in warm:
            out.append(line_no)
        elif group not in leading:
            leading.add(group)
            out.append(line_no)
    return out


class JobDeadline(NamedTuple):
    batch_id: str
    expires_at: float


def dispatch_order(jobs: Iterable[JobDeadline]) -> list[str]:
    """Across jobs, earliest deadline first (ties: the older id)."""
    return [j.batch_id for j in sorted(jobs, key=lambda j: (j.expires_at, j.batch_id))]


def finish_estimate(samples: Sequence[tuple[float, int]], total: int) -> tuple[float, float | None]:
    """(lines per second, predicted finish time) from (time, lines done) samples of one job, oldest first: the rate
    over the samples, the finish where the lines left end at that rate (None while there is no rate yet)."""
    if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
        return 0.0, None
    (t0, done0), (t1, done1) = samples[0], samples[-1]
    rate = (done1 - done0) / (t1 - t0)
    return rate, (t1 + (total - done1) / rate) if rate > 0 else None


def output_line(request_id: str, custom_id: str, status: int, upstream_request_id: str, body: Any) -> bytes:
    """A line of the output file (a 2xx answer) or of the error file (any other answer), as OpenAI writes both."""
    return orjson.dumps({"id": request_id, "custom_id": custom_id,
                         "response": {"status_code": status, "request_id": upstream_request_id, "body": body},
                         "error": None})


def failed_line(request_id: str, custom_id: str, code: str, message: str) -> bytes:
    """A line of the error file for a request that got no answer (`batch_expired`, ...)."""
    return orjson.dumps({"id": request_id, "custom_id": custom_id, "response": None,
                         "error": {"code": code, "message": message}})


EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
