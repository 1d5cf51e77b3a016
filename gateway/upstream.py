"""One upstream call to a replica, and its typed outcome: what both request paths send through.

The coordinator's attempts (gateway/coordinator.py) and the P/D path's prefill and decode calls (gateway/disagg.py)
call replicas through `Upstream`, so three things exist once:

- the outcome: `Streamed` (a stream whose first token's event came: the client's 200 may go), `Answered` (a complete
  body), or `Failed`, which says what went wrong and whether the request may have reached the replica (a KV transfer
  prepared for a replica that never received the request is untouched, and may be used again);
- the mapping from an exception to a failure. Timeouts come first: on Python 3.11 `asyncio.TimeoutError` is the
  built-in `TimeoutError`, an `OSError`, and aiohttp's read timeouts are both a `ClientError` and a `TimeoutError`;
  a replica that accepts a request and never answers is a 504 `upstream_timeout`, not a 502;
- the attempt's resources (the replica's load guard, the upstream response), owned by one `Held` that releases them
  together once, on every path; a stream hands it to its `StreamRelay`, which releases it when the stream ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import aiohttp
from multidict import CIMultiDictProxy
from starlette.requests import Request

from gateway.errors import UpstreamFailure
from gateway.learning import Learning
from gateway.migration import Resumer
from gateway.record import RequestRecord
from gateway.relay import (
    RETRYABLE_STATUS,
    DisconnectWatch,
    Held,
    RawResponse,
    StreamRelay,
    response_headers,
    upstream_headers,
)
from gateway.runtime import Gateway
from policies.classify import RequestProfile
from policies.replica_choice import RoutingDecision, RoutingRequest
from policies.vllm_wire import connection_refused, refuses_new_requests, usage_of
from pools.replicas import LoadGuard, PoolRuntime, Replica

# aiohttp's own errors and the OS's (a refused or reset connection; TimeoutError is one): a failed upstream call
UPSTREAM_ERRORS = (aiohttp.ClientError, OSError)

FailureKind = Literal["timeout", "unreachable", "answered_5xx", "answered_4xx", "kv_transfer_failed", "draining"]
_STATUS = {"timeout": 504, "unreachable": 502, "answered_5xx": 502, "answered_4xx": 502, "kv_transfer_failed": 502,
           "draining": 503}
_CODE = {"timeout": "upstream_timeout", "unreachable": "upstream_unreachable", "answered_5xx": "upstream_error",
         "answered_4xx": "upstream_error", "kv_transfer_failed": "kv_transfer_failed", "draining": "replica_draining"}


@dataclass(frozen=True, slots=True)
class Failed:
    """An upstream call that gave no answer to relay. `reached_replica`: the request may have reached the replica
    (False only when the connection was never made: nothing was sent)."""

    kind: FailureKind
    message: str
    reached_replica: bool

    def error(self) -> UpstreamFailure:
        """The client's answer when no other replica can be tried."""
        return UpstreamFailure(_STATUS[self.kind], self.message, _CODE[self.kind])


@dataclass(slots=True)
class Answered:
    """A complete (non-streamed) answer of the replica: relayed as it is, or read (an over-length refusal)."""

    status: int
    headers: list[tuple[bytes, bytes]]  # the response's, with m3gate's own x-m3gate-* headers
    body: bytes
    encoded: bool = False  # sent with a content-encoding: its usage is not read


@dataclass(slots=True)
class Streamed:
    """A stream whose first event arrived; the relay owns the attempt's resources from here on."""

    relay: StreamRelay


Outcome = Streamed | Answered | Failed


def blame_answered_5xx(replicas: Iterable[Replica], final_status: int, now: float) -> None:
    """The replicas that answered a request with a retryable 5xx, once its final answer is known. A request every
    replica answers with a 5xx is the request's fault (one client's odd input must not eject replicas); one another
    replica serves was theirs: each counts an answered 5xx (`Replica.record_failure`: ejected after a few in a
    row). Both doors apply it: the coordinator's retries and Envoy's, seen by the endpoint picker."""
    if final_status < 500:
        for replica in replicas:
            replica.record_failure(now, answered=True)


def failure_of(exc: BaseException, replica: Replica, pool: str) -> Failed:
    """The one mapping from a failed call's exception to its failure; timeouts first (see the module's docstring)."""
    if isinstance(exc, TimeoutError):  # asyncio's and aiohttp's timeouts alike
        return Failed("timeout", f"replica {replica.url} of pool '{pool}' did not answer in time",
                      reached_replica=not isinstance(exc, aiohttp.ConnectionTimeoutError))
    return Failed("unreachable", f"replica {replica.url} of pool '{pool}' is unreachable ({type(exc).__name__})",
                  reached_replica=not isinstance(exc, aiohttp.ClientConnectorError))


class Reply(NamedTuple):
    """A replica's reply: a complete body, or a stream's headers and first bytes (`held` still open)."""

    status: int
    headers: CIMultiDictProxy[str]
    data: bytes  # the body, or a stream's first chunk
    stream: bool
    t_headers: float


class Target(NamedTuple):
    """One replica the request may be sent to, and why it was chosen."""

    pool: PoolRuntime
    replica: Replica
    reason: str
    matched_blocks: int
    decision: RoutingDecision | None = None


@dataclass(slots=True)
class Attempt:
    """What every attempt of one request shares: the request, its profile, the client's headers and the disconnect
    watch; and the replicas that answered it with a 5xx (blamed only if another replica then serves it)."""

    request: Request
    record: RequestRecord
    profile: RequestProfile
    strip_usage: bool
    watch: DisconnectWatch
    raw_headers: list[tuple[bytes, bytes]] = field(init=False)
    answered_5xx: list[Replica] = field(default_factory=list)
    resumer: Resumer | None = None  # a stream broken after its first byte: how it is resumed (gateway/migration/)

    def __post_init__(self) -> None:
        self.raw_headers = self.request.scope["headers"]


class Upstream:
    """Sends attempts to replicas over the gateway's HTTP session; `finished` is the request's single end."""

    def __init__(self, gateway: Gateway, learning: Learning,
                 finished: Callable[[RequestRecord], Awaitable[None]]) -> None:
        self.gw = gateway
        self.learning = learning
        self.finished = finished

    async def exchange(self, replica: Replica, pool: str, url: str, payload: bytes, headers: dict[str, str],
                       held: Held, timeout: aiohttp.ClientTimeout | None = None) -> Reply | Failed:
        """POST and read the reply: the whole body, or a stream's first chunk (then `held` stays open for the
        relay; else it is released here). A failure is mapped, counted against the replica, and released."""
        gw = self.gw
        assert gw.session is not None
        try:
            held.response = response = await (
                gw.session.post(url, data=payload, headers=headers) if timeout is None  # the session's timeouts
                else gw.session.post(url, data=payload, headers=headers, timeout=timeout))
            t_headers = gw.clock()
            stream = response.headers.get("content-type", "").startswith("text/event-stream")
            data = await (response.content.readany() if stream else response.read())
        except UPSTREAM_ERRORS as exc:
            held.close()
            if connection_refused(exc):  # nothing listens: shutting down or restarting, not a failure to eject
                replica.start_draining("connection refused")
            else:
                replica.record_failure(gw.clock())
            return failure_of(exc, replica, pool)
        except BaseException:
            held.close()
            raise
        if not stream:
            held.close()
        return Reply(response.status, response.headers, data, stream, t_headers)

    async def send(self, attempt: Attempt, target: Target, payload: bytes, routing: RoutingRequest, *, number: int,
                   retried: bool, retry_left: bool, dispatched_as: RoutingRequest | None = None) -> Outcome:
        """One attempt on `target`: headers, dispatch bookkeeping, the call, then the answer or the stream's start.
        A retryable 5xx is a failure while another target is left; `dispatched_as`: the request as the pool's
        policy chose for it (a precise pool's exact block hashes), else `routing`."""
        record, pool, replica = attempt.record, target.pool, target.replica
        headers = upstream_headers(attempt.raw_headers, None)
        held = Held(self.dispatch(record, attempt.profile, target, routing, headers, dispatched_as=dispatched_as,
                                  number=number, retried=retried))
        extra = {"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url,
                 **self.gw.traffic.response_headers(record)}
        reply = await self.exchange(replica, pool.name, replica.url + record.path, payload, headers, held)
        if isinstance(reply, Failed):
            return reply
        record.t_headers = reply.t_headers
        if refuses_new_requests(reply.status, reply.data):  # shutting down: drained, and the request goes elsewhere
            replica.start_draining("refused a request (shutting down)")
            held.close(abort=True)
            return Failed("draining", f"replica {replica.url} of pool '{pool.name}' is shutting down",
                          reached_replica=False)
        if reply.status in RETRYABLE_STATUS and retry_left:
            held.close(abort=True)
            return Failed("answered_5xx", f"replica answered {reply.status}", reached_replica=True)
        record.status = reply.status
        if not reply.stream:
            if reply.status < 500:  # a stream is judged when it ends (`finished`): one broken after its first
                replica.record_success()  # byte counts against its replica like a failure before it
            return Answered(reply.status, response_headers(reply.headers, extra), reply.data,
                            "content-encoding" in reply.headers)
        # the client's 200 was held back until this first token's event: a replica that died during prefill was
        # then still retried elsewhere, unseen, instead of breaking a started stream
        record.t_first_byte = self.gw.clock()
        held.guard.first_token()  # its prefill no longer waits ahead of the replica's next requests
        if reply.data:
            self.learning.first_token(record, target.decision, replica)
        attempt.watch.stop()  # the StreamRelay watches for the disconnect from here on
        filt, resume = attempt.resumer.parts(held, replica, attempt.strip_usage) if attempt.resumer is not None \
            else (None, None)
        return Streamed(StreamRelay(held, reply.status, response_headers(reply.headers, extra), record,
                                    attempt.strip_usage, self.finished, first_chunk=reply.data, filt=filt,
                                    resume=resume))

    def dispatch(self, record: RequestRecord, profile: RequestProfile, target: Target, routing: RoutingRequest,
                 headers: dict[str, str], *, dispatched_as: RoutingRequest | None = None, number: int = 0,
                 retried: bool = False) -> LoadGuard:
        """What every send to `target` starts with, whoever makes the call (`send`; Envoy, for the endpoint picker):
        the attempt's record fields, the pool's key and the trace context added to `headers`, the replica's load
        guard (returned: the caller releases it), the send time, and what the replica now has in flight (its step
        clock, its pool's policy, other gateways). `dispatched_as`: the request as the pool's policy chose for it,
        else `routing`."""
        gw = self.gw
        pool, replica = target.pool, target.replica
        record.attempts = number + 1
        record.retried = retried
        record.pool, record.replica = pool.name, replica.url
        record.reason, record.matched_blocks, record.decision = target.reason, target.matched_blocks, target.decision
        key = pool.config.api_key.get_secret_value() if pool.config.api_key else None
        if key:
            headers["authorization"] = f"Bearer {key}"
        gw.telemetry.inject(record, headers)
        uncached = profile.prompt_tokens - target.matched_blocks * pool.config.block_size
        guard = replica.guard(profile.prompt_tokens + routing.expected_output, max(0, uncached))
        record.t_sent = gw.clock()
        decision, url = target.decision, replica.url
        if decision is not None and decision.prefill_plan is not None and decision.replica == url:
            replica.plan_step(record.t_sent, decision.prefill_plan)
        gw.policies[pool.name].dispatched(dispatched_as or routing, url, record.t_sent)
        gw.shared.on_dispatch(pool.name, url, routing)
        admission = gw.traffic.admission
        if admission.background and record.traffic_class not in admission.background:
            admission.make_room(pool.name, url, replica.in_flight, replica.batch_full_at)
        return guard

    async def resume(self, record: RequestRecord, target: Target, routing: RoutingRequest, path: str, payload: bytes,
                     tokens: int) -> tuple[Held, bytes] | Failed:
        """One continuation of a stream broken after its first byte (gateway/migration/), sent as every attempt
        is: the dispatch bookkeeping (the pool's policy, the prefix index, shared state), the call, and its failure
        classified (a shutting-down replica drained, a 5xx counted, a 4xx — the continuation's, not the replica's
        fault — neither). The record's first-attempt fields (send time, decision) stay the stream's. Returns the
        open stream (its `Held`, the first bytes) or the failure."""
        gw, pool, replica = self.gw, target.pool, target.replica
        headers = {"content-type": "application/json"}
        key = pool.config.api_key.get_secret_value() if pool.config.api_key else None
        if key:
            headers["authorization"] = f"Bearer {key}"
        gw.telemetry.inject(record, headers)
        held = Held(replica.guard(tokens))
        now = gw.clock()
        gw.policies[pool.name].dispatched(routing, replica.url, now)
        gw.shared.on_dispatch(pool.name, replica.url, routing)
        reply = await self.exchange(replica, pool.name, replica.url + path, payload, headers, held)
        if isinstance(reply, Failed):
            return reply
        if refuses_new_requests(reply.status, reply.data):
            replica.start_draining("refused a request (shutting down)")
            held.close(abort=True)
            return Failed("draining", f"replica {replica.url} of pool '{pool.name}' is shutting down", False)
        if reply.status != 200 or not reply.stream:
            held.close(abort=True)
            if reply.status >= 500:
                replica.record_failure(gw.clock(), answered=True)
                return Failed("answered_5xx", f"replica answered {reply.status}", reached_replica=True)
            return Failed("answered_4xx", f"replica answered {reply.status}", reached_replica=True)
        held.guard.first_token()
        return held, reply.data

    async def complete(self, record: RequestRecord, answered: Answered) -> RawResponse:
        """A complete answer goes to the client as it came: the request ends here."""
        gw = self.gw
        record.status = answered.status
        if record.session is not None and gw.sessions is not None:
            gw.sessions.answered(record, answered.body)
        record.t_first_byte = record.t_last_byte = gw.clock()
        if answered.status == 200 and not answered.encoded:
            record.usage = usage_of(answered.body)
        await self.finished(record)
        return RawResponse(answered.status, answered.headers, answered.body)

