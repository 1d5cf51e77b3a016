"""A disaggregated pool's request path: decide, prefill on a prefill replica, decode on a decode replica.

vLLM's KV-transfer protocol, exactly as its disaggregated-serving proxy examples
(`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`) speak it (the bodies: policies/vllm_wire.py):

1. the prefill request is the client's body computing one token, not streamed, with
   `kv_transfer_params: {"do_remote_decode": true, ...}` (`prefill_body`);
2. the `kv_transfer_params` of its answer go, as they came, into the client's own body for the decode replica
   (`decode_body`), which pulls the prompt's blocks and answers the client (streamed or not) through the ordinary
   upstream call (gateway/upstream.py). vLLM reports the prefill side's prefix hits as the answer's `cached_tokens`.

The decider (`policies.disagg.decide`) first sends short or mostly cached prompts straight to a decode replica: the
coordinator's ordinary path then serves it (`forward` returns None). Failures: a prefill replica that fails is
retried on another (all failed: the decode replica prefills itself); a decode replica that fails before its first
token is retried on another decode replica, with the same KV when the first never received the request
(`Failed.reached_replica`) and the lease still runs, else after prefilling again (the blocks may have been read,
freed, or lost with a restarted prefill replica); a decode replica whose first token does not come within
`transfer_timeout_s` fails the request with a 504 `kv_transfer_timeout`. Every call's in-flight count is released on
every path (`Held`), and the admission ticket is the request's, freed once by `Coordinator.finished`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import aiohttp
import orjson

from gateway.errors import UpstreamFailure
from gateway.record import PDRecord, RequestRecord
from gateway.relay import RETRYABLE_STATUS, Held, RawResponse, StreamRelay, response_headers, upstream_headers
from gateway.runtime import Gateway, policy_params
from gateway.upstream import UPSTREAM_ERRORS, Answered, Attempt, Failed, Reply, Streamed, Target, Upstream, failure_of
from policies.config import DisaggregationConfig
from policies.disagg import decide, rank_decode
from policies.pool_choice import PoolChoice
from policies.replica_choice import NoReplicaAvailable, ReplicaPolicy, RoutingRequest, build_policy
from policies.vllm_wire import decode_body, prefill_body, refuses_new_requests, usage_counts
from pools.replicas import PoolRuntime, Replica

log = logging.getLogger("m3gate.disagg")

MAX_PREFILL_ATTEMPTS = 2
MAX_DECODE_ATTEMPTS = 2
OFF_LOOP_BYTES = 64 * 1024  # bodies larger than this are parsed and serialised in a worker thread
T = TypeVar("T")


class _Prefilled:
    """A successful prefill: the KV-transfer params its answer gave, on which replica, and when."""

    __slots__ = ("at", "params", "replica")

    def __init__(self, params: dict[str, Any], replica: Replica, at: float):
        self.params, self.replica, self.at = params, replica, at


class Disaggregation:
    """The P/D path of every disaggregated pool; owned by the coordinator, calling replicas through `upstream`."""

    def __init__(self, gateway: Gateway, upstream: Upstream) -> None:
        self.gw = gateway
        self.upstream = upstream
        self._prefill_policies: dict[str, tuple[ReplicaPolicy | None, ReplicaPolicy]] = {}  # pool → (serving, prefill)
        self._warned_params = False

    # ---- entry ----------------------------------------------------------------------------------------------

    def handles(self, choice: PoolChoice) -> bool:
        return choice.pool.disaggregation is not None and choice.pool.name in self.gw.pools

    async def forward(
        self, attempt: Attempt, choice: PoolChoice, routing: RoutingRequest, direct_matched_blocks: int,
        payload: bytes,
    ) -> RawResponse | StreamRelay | None:
        """The answer of a disaggregated request, or None when the decider sends it straight to a decode replica
        (the coordinator's ordinary path, over the pool's decode replicas)."""
        gw = self.gw
        pool = gw.pools[choice.pool.name]
        cfg = choice.pool.disaggregation
        assert cfg is not None
        record = attempt.record
        prefill_up = any(r.is_available(gw.clock()) for r in pool.of_role("prefill"))
        decision = decide(attempt.profile.prompt_tokens, direct_matched_blocks * pool.config.block_size,
                          cfg.min_uncached_tokens, prefill_up, record.api)
        pd = record.pd = PDRecord(path=decision.path)
        gw.telemetry.pd_decision(pool.name, decision.path)
        if not decision.disaggregated:
            return None
        pd.off_loop = len(payload) > OFF_LOOP_BYTES
        body = await _off_loop(orjson.loads, payload, pd)
        prefilled = await self._prefill(attempt, pool, cfg, body, routing)
        if prefilled is None:  # no prefill replica could: the coordinator sends it straight to a decode replica
            pd.role = ""
            return None
        if isinstance(prefilled, RawResponse):
            return prefilled  # the prefill replica's 4xx answer
        pd.prefilled = True
        return await self._decode(attempt, pool, cfg, body, routing, prefilled)

    # ---- prefill --------------------------------------------------------------------------------------------

    def prefill_policy(self, pool: str) -> ReplicaPolicy:
        """The pool's routing policy over its prefill replicas (prefix affinity prices the uncached share), rebuilt
        whenever the runtime rebuilt the pool's own (policy or precise settings changed)."""
        gw = self.gw
        serving = gw.policies.get(pool)
        entry = self._prefill_policies.get(pool)
        if entry is None or entry[0] is not serving:
            policy = build_policy(gw.config.routing.policy, prefix_index=gw.precise.matcher(pool),
                                  **policy_params(gw.config))
            entry = self._prefill_policies[pool] = (serving, policy)
        return entry[1]

    def prefill_targets(
        self, pool: PoolRuntime, routing: RoutingRequest, avoid: Replica | None = None
    ) -> list[Replica]:
        gw = self.gw
        now = gw.clock()
        try:
            decision = self.prefill_policy(pool.name).choose(routing, pool.snapshots(now, gw.shared, "prefill"), now)
        except NoReplicaAvailable:
            return []
        out = [r for url in (decision.replica, *decision.fallbacks)
               if (r := pool.replicas.get(url)) is not None and r.is_available(now)]
        if avoid is not None and len(out) > 1 and out[0] is avoid:
            out.append(out.pop(0))
        return out[:MAX_PREFILL_ATTEMPTS]

    async def _prefill(
        self, attempt: Attempt, pool: PoolRuntime, cfg: DisaggregationConfig, body: dict[str, Any],
        routing: RoutingRequest, avoid: Replica | None = None,
    ) -> _Prefilled | RawResponse | None:
        """Prefill on the best prefill replica, the next on failure. Returns the KV-transfer params, the replica's
        own 4xx answer (the request's fault: the client gets it), or None when no prefill replica could."""
        gw = self.gw
        record = attempt.record
        pd = _pd(record)
        payload = await _off_loop(orjson.dumps, prefill_body(body), pd)
        timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout_s or gw.config.server.upstream_read_timeout_s)
        for replica in self.prefill_targets(pool, routing, avoid):
            sent = self._prefill_sent(attempt, pool, replica, routing)
            held = Held(replica.guard(routing.prompt_tokens + 1))
            headers = self._headers(attempt, pool)
            reply = await self.upstream.exchange(replica, pool.name, replica.url + record.path, payload, headers,
                                                 held, timeout)
            held.close()  # a prefill answer is read whole, never relayed as a stream
            if isinstance(reply, Failed):
                log.warning("pool %s: prefill replica %s failed (%s)", pool.name, replica.url, reply.message)
                continue
            done = gw.clock()
            if reply.status in RETRYABLE_STATUS:
                if refuses_new_requests(reply.status, reply.data):  # shutting down: drained, not a failure
                    replica.start_draining("refused a request (shutting down)")
                else:
                    replica.record_failure(done, answered=True)
                continue
            replica.record_success()
            if reply.status != 200:  # the request's own fault (too long, bad parameter): the client hears it
                return await self._refused(record, pool, replica, reply)
            return self._prefilled(record, pool, replica, reply, sent, done)
        log.warning("pool %s: no prefill replica could prefill; the decode replica prefills", pool.name)
        pd.path = "prefill_failed"
        return None

    def _prefill_sent(self, attempt: Attempt, pool: PoolRuntime, replica: Replica, routing: RoutingRequest) -> float:
        """A prefill call's record fields and dispatch bookkeeping; returns its send time."""
        gw = self.gw
        record = attempt.record
        pd = _pd(record)
        record.attempts += 1
        record.pool, record.replica, pd.role = pool.name, replica.url, "prefill"
        sent = record.t_sent = gw.clock()
        pd.first_sent = pd.first_sent or sent  # the gateway's overhead ends at the first call
        self.prefill_policy(pool.name).dispatched(routing, replica.url, sent)
        gw.shared.on_dispatch(pool.name, replica.url, routing)
        return sent

    def _headers(self, attempt: Attempt, pool: PoolRuntime) -> dict[str, str]:
        key = pool.config.api_key.get_secret_value() if pool.config.api_key else None
        headers = upstream_headers(attempt.raw_headers, key)
        self.gw.telemetry.inject(attempt.record, headers)
        return headers

    async def _refused(self, record: RequestRecord, pool: PoolRuntime, replica: Replica, reply: Reply) -> RawResponse:
        """The prefill replica's 4xx answer, relayed to the client as it came."""
        extra = {"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url,
                 **self.gw.traffic.response_headers(record)}
        return await self.upstream.complete(record, Answered(reply.status, response_headers(reply.headers, extra),
                                                             reply.data))

    def _prefilled(self, record: RequestRecord, pool: PoolRuntime, replica: Replica, reply: Reply, sent: float,
                   done: float) -> _Prefilled | None:
        """The KV-transfer params of a prefill replica's answer; None (logged once) when it has none: the replica
        was not launched for disaggregation."""
        data = _json(reply.data)
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            if not self._warned_params:
                self._warned_params = True
                log.error("pool %s: prefill replica %s answered without kv_transfer_params: launch it with "
                          "--kv-transfer-config (m3gate pools render); its requests are decoded without "
                          "disaggregation until it does", pool.name, replica.url)
            return None
        usage = data.get("usage")
        if isinstance(usage, dict) and usage:
            prompt, _, cached = usage_counts(usage)
            replica.observe_latency(max(0, prompt - cached), done - sent, 0, 0.0)
        pd = _pd(record)
        pd.prefill_s, pd.prefill_replica = done - sent, replica.url
        self.gw.telemetry.pd_stage("prefill", record, done - sent)
        return _Prefilled(params, replica, done)

    # ---- decode ---------------------------------------------------------------------------------------------

    def decode_targets(self, pool: PoolRuntime, routing: RoutingRequest, tried: Sequence[Replica]) -> list[Replica]:
        gw = self.gw
        now = gw.clock()
        try:
            decision = rank_decode(routing, pool.snapshots(now, gw.shared))
        except NoReplicaAvailable:
            return []
        ranked = [r for url in (decision.replica, *decision.fallbacks)
                  if (r := pool.replicas.get(url)) is not None and r.is_available(now)]
        return [r for r in ranked if r not in tried] + [r for r in ranked if r in tried]

    async def _decode(
        self, attempt: Attempt, pool: PoolRuntime, cfg: DisaggregationConfig, body: dict[str, Any],
        routing: RoutingRequest, prefilled: _Prefilled,
    ) -> RawResponse | StreamRelay:
        """Decode on the best decode replica, the next if it fails before its first token. A decode replica's 5xx
        may be the prefill side's fault (vLLM fails a request whose KV it could not load): it is not held against
        it (health checks and direct requests still judge it)."""
        tried: list[Replica] = []
        failure: Failed | None = None
        for number in range(MAX_DECODE_ATTEMPTS):
            targets = self.decode_targets(pool, routing, tried)
            if not targets:
                break
            replica = targets[0]
            tried.append(replica)
            last = number == MAX_DECODE_ATTEMPTS - 1
            outcome = await self._decode_call(attempt, pool, replica, cfg, body, routing, prefilled, not last)
            if not isinstance(outcome, Failed):
                return outcome
            failure = outcome
            log.warning("pool %s: decode replica %s failed before its first token (%s)", pool.name, replica.url,
                        outcome.message)
            if last:
                break
            # The same KV only if that replica never got the request (the blocks are untouched) and the lease runs.
            if outcome.reached_replica or self.gw.clock() - prefilled.at > cfg.kv_lease_s * 0.8:
                again = await self._prefill(attempt, pool, cfg, body, routing, avoid=prefilled.replica)
                if isinstance(again, RawResponse):
                    return again
                if again is None:
                    break
                prefilled = again
        if failure is not None:
            raise failure.error()
        raise UpstreamFailure(503, f"No healthy decode replica in pool '{pool.name}'; retry shortly.",
                              "no_healthy_replica")

    async def _decode_call(
        self, attempt: Attempt, pool: PoolRuntime, replica: Replica, cfg: DisaggregationConfig, body: dict[str, Any],
        routing: RoutingRequest, prefilled: _Prefilled, retry_left: bool,
    ) -> RawResponse | StreamRelay | Failed:
        """One decode call; a stream is handed on only once its first token came (not vLLM's failed KV load)."""
        record = attempt.record
        pd = _pd(record)
        payload = await _off_loop(orjson.dumps, decode_body(body, prefilled.params), pd)
        pd.role = "decode"
        started = self.gw.clock()
        target = Target(pool, replica, "disaggregated", 0)
        try:
            async with asyncio.timeout(cfg.transfer_timeout_s if record.stream else None):
                outcome = await self.upstream.send(attempt, target, payload, routing, number=record.attempts,
                                                   retried=False, retry_left=retry_left)
                if isinstance(outcome, Streamed):
                    outcome = await self._first_token(outcome, replica, pool.name, prefilled.replica)
        except TimeoutError:
            raise UpstreamFailure(
                504, f"KV transfer from prefill replica {prefilled.replica.url} to decode replica {replica.url} "
                f"did not complete within {cfg.transfer_timeout_s:g} s (disaggregation.transfer_timeout_s)",
                "kv_transfer_timeout") from None
        if isinstance(outcome, Failed):
            return outcome
        if isinstance(outcome, Answered):
            return await self.upstream.complete(record, outcome)
        if record.stream and record.t_first_byte:
            self.gw.telemetry.pd_stage("transfer", record, record.t_first_byte - started)
        return outcome.relay

    async def _first_token(self, streamed: Streamed, replica: Replica, pool: str,
                           prefill: Replica) -> Streamed | Failed:
        """The decode stream, once its first token's event came; a failure when vLLM could not load the KV blocks
        (or the stream broke first). A stream not handed on is abandoned: closed (vLLM aborts), its in-flight count
        freed."""
        relay = streamed.relay
        try:
            ok = await _first_token_ok(relay)
        except UPSTREAM_ERRORS as exc:
            relay.abandon()
            replica.record_failure(self.gw.clock())
            return failure_of(exc, replica, pool)
        except BaseException:  # timed out or cancelled while reading: the stream is not handed on
            relay.abandon()
            raise
        if ok:
            return streamed
        relay.abandon()
        return Failed("kv_transfer_failed", f"decode replica {replica.url} could not load the KV blocks prefilled "
                      f"on {prefill.url}", reached_replica=True)

    # ---- telemetry ------------------------------------------------------------------------------------------

    def finished(self, record: RequestRecord) -> None:
        """At the request's end: the decode stage's histogram (first to last token; a non-streamed request's whole
        decode call)."""
        pd = record.pd
        if pd is None or not pd.prefilled or record.status != 200 or not record.t_last_byte:
            return
        start = record.t_first_byte if record.stream and record.t_first_byte else record.t_sent
        if start:
            self.gw.telemetry.pd_stage("decode", record, record.t_last_byte - start)


def _pd(record: RequestRecord) -> PDRecord:
    pd = record.pd
    assert pd is not None  # `forward` made it
    return pd


async def _off_loop(work: Callable[[Any], T], arg: Any, pd: PDRecord) -> T:
    """JSON work on a long prompt's body (megabytes) in a worker thread, as the coordinator classifies it."""
    if pd.off_loop:
        return await asyncio.to_thread(work, arg)
    return work(arg)


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


async def _first_token_ok(relay: StreamRelay) -> bool:
    """vLLM answers a decode request whose KV could not be loaded with a 200 stream of the role chunk, then an
    error event: read past role-only chunks (they come with the first token) to tell that from a first token."""
    while True:
        chunk = relay.first_chunk
        if b'data: {"error"' in chunk:
            return False
        if not _role_only(chunk):
            return True
        if not await relay.read_ahead():
            return True


def _role_only(chunk: bytes) -> bool:
    events = [e for e in chunk.split(b"\n\n") if e.strip()]
    return bool(events) and all(b'"role"' in e and b'"content":""' in e for e in events)
