"""`RequestRecord`: what happened to one request, filled in by each stage and read by telemetry when it ends.

The record is the one value every part of the request path shares (coordinator, admission, relay, telemetry), so it
lives at the bottom of `gateway/` and imports nothing of m3gate's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    t_classified: float = 0.0
    t_routed: float = 0.0  # pool and replica chosen
    t_admitted: float = 0.0  # left the gateway's admission queue (== t_routed when nothing waited)
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
    extra: dict[str, Any] = field(default_factory=dict)
