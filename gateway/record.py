"""`RequestRecord`: what happened to one request, filled in by each stage and read by telemetry when it ends.

The record is the one value every part of the request path shares (coordinator, admission, relay, telemetry), so it
lives at the bottom of `gateway/` and imports nothing of the gateway's (only the pure wire helpers of `policies/`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from policies.vllm_wire import usage_counts

NO_TOKENS = (0, 0, 0)


class Releasable(Protocol):
    """A held resource freed once when the request ends (gateway/admission.py's admission ticket)."""

    def release(self, served: float = 0.0, output: float = 0.0) -> None: ...


class EngineSplit(NamedTuple):
    """The replica's own timing of the request (its llm_request span; None: not reported), for the status page."""

    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None


@dataclass(slots=True)
class PDRecord:
    """What happened on a disaggregated pool's path (gateway/disagg.py)."""

    path: str = ""  # the decider's path (policies.disagg.PATHS), or "prefill_failed"
    role: str = ""  # the side of the call in progress: prefill | decode | "" (the ordinary path, no P/D)
    prefilled: bool = False  # a prefill replica computed the prompt: the decode replica only pulled its KV
    off_loop: bool = False  # the body is large: parsed and serialised in a worker thread
    first_sent: float = 0.0  # the first call's send time (the gateway's own overhead ends there)
    prefill_s: float = 0.0  # the successful prefill call, sent → answered
    prefill_replica: str = ""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, stage by stage (monotonic seconds); telemetry reads it when it ends."""

    api: str
    stream: bool
    t_arrival: float
    pool: str = ""
    replica: str = ""
    reason: str = ""
    traffic_class: str = ""
    thinking_mode: str = ""
    prompt_tokens_est: int = 0
    prompt_tokens_raw: int = 0  # the estimate before any learned correction; 0 when the model's tokenizer counted it
    matched_blocks: int = 0
    decision: Any = None  # the attempt's RoutingDecision (predictions, calibration inputs, SLO verdict)
    ttft_slo_s: float | None = None  # the objective it was routed against, if any
    session: Any = None  # its agent-session turn (gateway/sessions.py's SessionTurn), when sessions are tracked
    first_pool: str = ""  # the pool pool choice picked; `pool` differs when the request spilled at forward time
    pool_reason: str = ""  # pool choice's reason: fits, forced, spill:<pool>, clamped, near_limit, all_saturated
    max_tokens: int | None = None  # the caller's explicit output cap, if any
    output_predicted: int = 0  # the output tokens it was expected to generate (policies/output_estimate.py); 0: none
    output_basis: Any = None  # what that estimate rested on (gateway/learning.py's), to learn from the answer
    t_classified: float = 0.0
    t_routed: float = 0.0  # pool and replica chosen
    t_admitted: float = 0.0  # left the gateway's admission queue (== t_routed when nothing waited)
    queue_s: float = 0.0  # time spent waiting in the admission queue (0: admitted without waiting); x-m3gate-queue-ms
    t_sent: float = 0.0
    t_headers: float = 0.0  # the replica's response headers arrived (a stream's headers precede its first token)
    t_first_byte: float = 0.0  # first body bytes (streams: the first token's event)
    t_last_byte: float = 0.0
    status: int = 0
    attempts: int = 0
    retried: bool = False
    usage: dict[str, Any] | None = None
    error: str | None = None
    client_disconnected: bool = False
    trace: Any = None  # telemetry's per-request state (span), opaque to everything else
    path: str = ""  # the request's URL path, which the upstream call repeats
    done: bool = False  # `Coordinator.finished` ran (it runs once)
    pd: PDRecord | None = None  # the P/D path's state, on a disaggregated pool only
    itl: tuple[list[float], tuple[float, ...]] | None = None  # a stream's inter-token series (metrics.BucketSeries)
    # the replica's timing, once its span was joined (gateway/observability/engine_spans.py)
    engine: EngineSplit | None = None
    admission_ticket: Releasable | None = None  # the admission slot, held until `finished`
    migrations: int = 0  # times the stream was resumed on another replica after its replica failed (gateway/migration/)
    t_cut: float = 0.0  # the first such failure
    migration_events: list[tuple[float, int, str]] | None = None  # (when, generated tokens kept, new endpoint)
    ratelimit_headers: dict[str, str] | None = None  # the key's x-ratelimit-* headers, once its quota was checked
    _tokens: tuple[Any, tuple[int, int, int]] | None = field(default=None, init=False, repr=False)

    def tokens(self) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt) tokens of `usage` (`usage_counts`), counted once however many readers
        the finished request has (learning, capacity, sessions, metrics, spans, the status page)."""
        usage = self.usage
        if usage is None:
            return NO_TOKENS
        known = self._tokens
        if known is not None and known[0] is usage:  # counted for this very usage object
            return known[1]
        counts = usage_counts(usage)
        self._tokens = (usage, counts)
        return counts
