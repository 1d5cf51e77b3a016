"""`RecentRequests`: the latest finished requests, for the status page's stage waterfall (GET /ui).

A bounded ring of `RequestRecord`s, fed once per request from `Coordinator.finished`. It keeps records only while
someone is looking: the page's poll (`watched`) opens a window of `WATCH_S` seconds; a request that arrives after the
window closed is not kept. So with the page closed a request pays one attribute read and one comparison (~40 ns);
with it open, one `deque.append` of the record itself (O(1), no copying: the record is finished and never written
again). Formatting happens when the page asks (`view`), off the request path.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gateway.record import RequestRecord

WATCH_S = 30.0  # how long one poll of /ui/state keeps the ring recording


class RecentRequests:
    __slots__ = ("ring", "active_until")

    def __init__(self, size: int = 64) -> None:
        self.ring: deque[RequestRecord] = deque(maxlen=size)
        self.active_until = float("-inf")  # monotonic; requests arriving after it are not kept

    def add(self, record: RequestRecord) -> None:
        if record.t_arrival < self.active_until:
            self.ring.append(record)

    def watched(self, now: float) -> None:
        """The page polled: keep recording for the next WATCH_S seconds."""
        self.active_until = now + WATCH_S

    def view(self, now: float, wall_now: float, limit: int = 30) -> list[dict[str, Any]]:
        """The latest `limit` requests, newest first, each with its stages in ms from its arrival."""
        out = []
        for record in list(self.ring)[-limit:][::-1]:
            out.append(waterfall(record, now, wall_now))
        return out


def waterfall(record: RequestRecord, now: float, wall_now: float) -> dict[str, Any]:
    """One request's stages, as far as the gateway saw them: its own work (body, classification, pool and replica
    choice), the admission queue, the replica until the first token (the engine's queue and prefill, which the
    gateway sees as one span unless the record carries the engine's own split), and decode."""
    t0 = record.t_arrival
    end = record.t_last_byte or record.t_first_byte or record.t_sent or record.t_admitted or record.t_routed or t0
    stages: list[dict[str, Any]] = []

    def stage(name: str, start: float, stop: float) -> None:
        if start and stop and stop >= start:
            stages.append({"stage": name, "start_ms": round((start - t0) * 1000, 3),
                           "ms": round((stop - start) * 1000, 3)})

    routed = record.t_routed or record.t_classified
    stage("gateway", t0, routed or record.t_sent)
    if record.t_admitted and record.t_routed:
        stage("gateway queue", record.t_routed, record.t_admitted)
    stage("dispatch", record.t_admitted or routed, record.t_sent)
    engine = record.engine  # the replica's own split, when its span was joined
    first = record.t_first_byte or (record.t_last_byte if not record.stream else 0.0)
    if record.t_sent and first:
        if engine is not None and engine.queue_s is not None:
            queue_end = record.t_sent + engine.queue_s
            stage("engine queue", record.t_sent, min(queue_end, first))
            stage("prefill", min(queue_end, first), first)
        else:
            stage("engine queue + prefill", record.t_sent, first)
    if record.stream and record.t_first_byte and record.t_last_byte:
        if record.t_cut:  # its replica failed mid-stream: the seam, then the resumed part (gateway/migration/)
            stage("decode", record.t_first_byte, record.t_cut)
            stage("resumed decode", record.t_cut, record.t_last_byte)
        else:
            stage("decode", record.t_first_byte, record.t_last_byte)
    prompt, output, _ = record.tokens()
    return {
        "at": round(wall_now - (now - t0), 3),
        "api": record.api, "stream": record.stream, "pool": record.pool or record.first_pool,
        "replica": record.replica, "class": record.traffic_class, "thinking_mode": record.thinking_mode,
        "status": 499 if record.client_disconnected else record.status, "error": record.error,
        "retried": record.retried, "reason": record.reason, "migrations": record.migrations,
        "prompt_tokens": prompt if record.usage else record.prompt_tokens_est,
        "output_tokens": output if record.usage else None,
        "total_ms": round((end - t0) * 1000, 3), "stages": stages,
    }
