"""A disaggregated pool's request path: decide, prefill on a prefill replica, decode on a decode replica.

vLLM's KV-transfer protocol, exactly as its disaggregated-serving proxy examples
(`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`) speak it:

1. the prefill request is the client's body with `max_tokens: 1` (and `max_completion_tokens: 1` when present),
   `stream: false`, no `stream_options`, and `kv_transfer_params: {"do_remote_decode": true, ...}`;
2. the `kv_transfer_params` of its answer go, as they came, into the client's own body for the decode replica,
   which pulls the prompt's blocks and answers the client (streamed or not) through the coordinator's ordinary
   relay. vLLM reports the prefill side's prefix hits as the answer's `cached_tokens`.

The decider (`policies.disagg.decide`) first sends short or mostly cached prompts straight to a decode replica: the
coordinator's ordinary path then serves it (`forward` returns None). Failures: a prefill replica that fails is
retried on another (all failed: the decode replica prefills itself); a decode replica that fails before its first
token is retried on another decode replica, with the same KV when the first never received the request and the
lease still runs, else after prefilling again (the blocks may have been read, freed, or lost with a restarted
prefill replica); a decode replica whose first token does not come within `transfer_timeout_s` fails the request
with a 504 `kv_transfer_timeout`. Every in-flight count is a `Replica.guard()` released on every path, and the
admission ticket is the request's, freed once by `Coordinator.finished`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

import aiohttp
import orjson

from gateway.errors import UpstreamFailure
from gateway.metrics import STAGE_BUCKETS, CounterTable, HistogramTable
from gateway.record import RequestRecord
from gateway.relay import (
    RETRYABLE_STATUS,
    DisconnectWatch,
    RawResponse,
    response_headers,
    upstream_headers,
)
from gateway.runtime import Gateway
from policies.config import DisaggregationConfig
from policies.disagg import PATHS, PDDecision, decide, rank_decode
from policies.pool_choice import PoolChoice
from policies.replica_choice import (
    NoReplicaAvailable,
    ReplicaPolicy,
    RoutingRequest,
    build_policy,
)
from pools.replicas import PoolRuntime, Replica

log = logging.getLogger("m3gate.disagg")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
MAX_PREFILL_ATTEMPTS = 2
MAX_DECODE_ATTEMPTS = 2
PD_BUCKETS = (*STAGE_BUCKETS, 60.0, 120.0, 300.0)
OFF_LOOP_BYTES = 64 * 1024  # bodies larger than this are parsed and serialised in a worker thread


class Attempts(Protocol):
    """What the coordinator's per-request attempt state offers (`coordinator._Attempts`)."""

    record: RequestRecord
    payload: bytes
    raw_headers: list[tuple[bytes, bytes]]
    heal: bool
    answered_5xx: list[Replica]

    @property
    def profile(self) -> Any: ...


class Relay(Protocol):
    """The coordinator's side: one upstream call through its relay, and the single end of every request."""

    def send(self, attempt: Any, number: int, pool: PoolRuntime, replica: Replica, reason: str,
             routing: RoutingRequest, retry_left: bool, watch: DisconnectWatch) -> Awaitable[Any]: ...

    def finished(self, record: RequestRecord) -> Awaitable[None]: ...


class _Prefilled:
    __slots__ = ("at", "params", "replica", "usage")

    def __init__(self, params: dict[str, Any], replica: Replica, at: float, usage: dict[str, Any] | None):
        self.params, self.replica, self.at, self.usage = params, replica, at, usage


class Disaggregation:
    """The P/D path of every disaggregated pool; owned by the coordinator, over the gateway's state."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._prefill_policies: dict[str, tuple[Any, ReplicaPolicy]] = {}  # pool → (serving policy, prefill's)
        self._registry: Any = None
        self.decisions: CounterTable | None = None
        self.prefill_s: HistogramTable | None = None
        self.transfer_s: HistogramTable | None = None
        self.decode_s: HistogramTable | None = None
        self._warned_params = False

    # ---- entry ----------------------------------------------------------------------------------------------

    def handles(self, choice: PoolChoice) -> bool:
        return choice.pool.disaggregation is not None and choice.pool.name in self.gw.pools

    async def forward(
        self, relay: Relay, attempt: Attempts, choice: PoolChoice, routing: RoutingRequest, direct_matched_blocks: int,
        watch: DisconnectWatch,
    ) -> Any:
        """The answer of a disaggregated request, or None when the decider sends it straight to a decode replica
        (the coordinator's ordinary path, over the pool's decode replicas)."""
        gw = self.gw
        pool = gw.pools[choice.pool.name]
        cfg = choice.pool.disaggregation
        assert cfg is not None
        record: RequestRecord = attempt.record
        now = gw.clock()
        prefill_up = any(r.is_available(now) for r in pool.of_role("prefill"))
        decision = decide(attempt.profile.prompt_tokens, direct_matched_blocks * pool.config.block_size,
                          cfg.min_uncached_tokens, prefill_up, record.api)
        self._count(pool.name, decision)
        record.extra["pd_path"] = decision.path
        if not decision.disaggregated:
            return None
        record.extra["pd_big"] = len(attempt.payload) > OFF_LOOP_BYTES
        body = await _off_loop(orjson.loads, attempt.payload, record)
        record.extra["pd"] = True
        prefilled = await self._prefill(relay, attempt, pool, cfg, body, routing, watch)
        if prefilled is None:  # no prefill replica could: the coordinator sends it straight to a decode replica
            record.extra["pd"], record.extra["pd_role"] = False, ""
            return None
        if not isinstance(prefilled, _Prefilled):
            return prefilled  # the prefill replica's 4xx answer
        return await self._decode(relay, attempt, pool, cfg, body, routing, prefilled, watch)

    # ---- prefill --------------------------------------------------------------------------------------------

    def prefill_policy(self, pool: str) -> ReplicaPolicy:
        """The pool's routing policy over its prefill replicas (prefix affinity prices the uncached share), rebuilt
        whenever the runtime rebuilt the pool's own (policy or precise settings changed)."""
        gw = self.gw
        serving = gw.policies.get(pool)
        entry = self._prefill_policies.get(pool)
        if entry is None or entry[0] is not serving:
            params: dict[str, Any] = {}
            if gw.config.routing.policy != "round_robin":
                params = {"load_epsilon": gw.config.routing.load_epsilon, "load_slack": gw.config.routing.load_slack}
            policy = build_policy(gw.config.routing.policy, prefix_index=gw.precise.matcher(pool), **params)
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
        self, relay: Relay, attempt: Attempts, pool: PoolRuntime, cfg: DisaggregationConfig, body: dict[str, Any],
        routing: RoutingRequest, watch: DisconnectWatch, avoid: Replica | None = None,
    ) -> _Prefilled | RawResponse | None:
        """Prefill on the best prefill replica, the next on failure. Returns the KV-transfer params, the replica's
        own 4xx answer (the request's fault: the client gets it), or None when no prefill replica could."""
        gw = self.gw
        assert gw.session is not None
        record: RequestRecord = attempt.record
        payload = await _off_loop(orjson.dumps, prefill_body(body), record)
        key = pool.config.api_key.get_secret_value() if pool.config.api_key else None
        timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout_s or gw.config.server.upstream_read_timeout_s)
        for replica in self.prefill_targets(pool, routing, avoid):
            record.attempts += 1
            record.pool, record.replica, record.extra["pd_role"] = pool.name, replica.url, "prefill"
            headers = upstream_headers(attempt.raw_headers, key)
            gw.telemetry.inject(record, headers)
            guard = replica.guard(routing.prompt_tokens + 1)
            sent = gw.clock()
            record.t_sent = sent
            record.extra.setdefault("pd_first_sent", sent)  # the gateway's overhead ends at the first call
            self.prefill_policy(pool.name).dispatched(routing, replica.url, sent)
            gw.shared.on_dispatch(pool.name, replica.url, routing)
            try:
                async with gw.session.post(replica.url + record.extra["path"], data=payload, headers=headers,
                                           timeout=timeout) as resp:
                    answer = await resp.read()
                    status = resp.status
                    upstream_headers_ = resp.headers
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                replica.record_failure(gw.clock())
                log.warning("pool %s: prefill replica %s failed (%s)", pool.name, replica.url, type(exc).__name__)
                continue
            finally:
                guard.release()
            done = gw.clock()
            if status in RETRYABLE_STATUS:
                replica.record_failure(done, answered=True)
                continue
            if status != 200:  # the request's own fault (too long, bad parameter): the client hears it
                replica.record_success()
                record.status = status
                record.t_first_byte = record.t_last_byte = done
                extra = {"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url,
                         **gw.traffic.response_headers(record)}
                await relay.finished(record)
                return RawResponse(status, response_headers(upstream_headers_, extra), answer)
            replica.record_success()
            data = _json(answer)
            params = data.get("kv_transfer_params") if isinstance(data, dict) else None
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                if not self._warned_params:
                    self._warned_params = True
                    log.error("pool %s: prefill replica %s answered without kv_transfer_params: launch it with "
                              "--kv-transfer-config (m3gate pools render); its requests are decoded without "
                              "disaggregation until it does", pool.name, replica.url)
                return None
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                replica.observe_latency(max(0, (usage.get("prompt_tokens") or 0) - cached), done - sent, 0, 0.0)
            self._observe(self.prefill_s, record, done - sent)
            record.extra["pd_prefill_s"] = done - sent
            record.extra["pd_prefill_replica"] = replica.url
            return _Prefilled(params, replica, done, usage)
        log.warning("pool %s: no prefill replica could prefill; the decode replica prefills", pool.name)
        record.extra["pd_path"] = "prefill_failed"
        return None

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
        self, relay: Relay, attempt: Attempts, pool: PoolRuntime, cfg: DisaggregationConfig, body: dict[str, Any],
        routing: RoutingRequest, prefilled: _Prefilled, watch: DisconnectWatch,
    ) -> Any:
        gw = self.gw
        record: RequestRecord = attempt.record
        attempt.heal = False  # an over-length answer was the prefill's to give
        tried: list[Replica] = []
        failure: UpstreamFailure | None = None
        for number in range(MAX_DECODE_ATTEMPTS):
            targets = self.decode_targets(pool, routing, tried)
            if not targets:
                break
            replica = targets[0]
            tried.append(replica)
            attempt.payload = await _off_loop(orjson.dumps, {**body, "kv_transfer_params": prefilled.params}, record)
            record.extra["pd_role"] = "decode"
            last = number == MAX_DECODE_ATTEMPTS - 1
            started = gw.clock()
            try:
                async with asyncio.timeout(cfg.transfer_timeout_s if record.stream else None):
                    outcome = await relay.send(attempt, record.attempts, pool, replica, "disaggregated", routing,
                                               retry_left=not last, watch=watch)
                    if _is_stream(outcome):
                        try:
                            ok = await _first_token_ok(outcome)
                        except BaseException:  # timed out or cancelled while reading: the stream is not handed on
                            _drop(outcome)
                            raise
                        if not ok:
                            _drop(outcome)
                            outcome = UpstreamFailure(502, f"decode replica {replica.url} could not load the KV "
                                                      f"blocks prefilled on {prefilled.replica.url}",
                                                      "kv_transfer_failed")
            except TimeoutError:
                raise UpstreamFailure(
                    504, f"KV transfer from prefill replica {prefilled.replica.url} to decode replica {replica.url} "
                    f"did not complete within {cfg.transfer_timeout_s:g} s (disaggregation.transfer_timeout_s)",
                    "kv_transfer_timeout") from None
            if not isinstance(outcome, UpstreamFailure):
                if record.stream and record.t_first_byte:
                    self._observe(self.transfer_s, record, record.t_first_byte - started)
                return outcome
            failure = outcome
            # A decode replica's 5xx may be the prefill side's fault (vLLM fails a request whose KV it could not
            # load): not held against it (health checks and direct requests still judge it).
            attempt.answered_5xx.clear()
            log.warning("pool %s: decode replica %s failed before its first token (%s)", pool.name, replica.url,
                        outcome.message)
            if last:
                break
            # The same KV only if that replica never got the request (the blocks are untouched) and the lease runs.
            untouched = outcome.code == "upstream_unreachable" and "ClientConnectorError" in outcome.message
            if not untouched or gw.clock() - prefilled.at > cfg.kv_lease_s * 0.8:
                again = await self._prefill(relay, attempt, pool, cfg, body, routing, watch, avoid=prefilled.replica)
                if isinstance(again, RawResponse):
                    return again
                if again is None:
                    break
                prefilled = again
        raise failure or UpstreamFailure(
            503, f"No healthy decode replica in pool '{pool.name}'; retry shortly.", "no_healthy_replica")

    # ---- telemetry ------------------------------------------------------------------------------------------

    def finished(self, record: RequestRecord) -> None:
        """At the request's end: the decode stage's histogram (first to last token; a non-streamed request's whole
        decode call)."""
        if not record.extra.get("pd") or record.status != 200 or not record.t_last_byte:
            return
        start = record.t_first_byte if record.stream and record.t_first_byte else record.t_sent
        if start:
            self._observe(self.decode_s, record, record.t_last_byte - start)

    def _tables(self) -> bool:
        metrics = getattr(self.gw.telemetry, "metrics", None)
        if metrics is None:
            return False
        if metrics.registry is not self._registry:
            r = self._registry = metrics.registry
            labels = ("pool", "class")
            self.decisions = CounterTable(r, "m3gate_pd_decisions", "Requests to disaggregated pools by the decider's "
                                          "path (disaggregated, decode_short, decode_cached, decode_no_prefill, "
                                          "decode_unsupported).", ("pool", "path"))
            self.prefill_s = HistogramTable(r, "m3gate_pd_prefill_seconds", "Disaggregated requests: the prefill "
                                            "call (sent to the prefill replica until its answer).", labels, PD_BUCKETS)
            self.transfer_s = HistogramTable(r, "m3gate_pd_transfer_seconds", "Disaggregated streams: sent to the "
                                             "decode replica until its first token (KV pull + one step).", labels,
                                             PD_BUCKETS)
            self.decode_s = HistogramTable(r, "m3gate_pd_decode_seconds", "Disaggregated requests: first to last "
                                           "token on the decode replica (non-streamed: the whole decode call).",
                                           labels, PD_BUCKETS)
        return True

    def _count(self, pool: str, decision: PDDecision) -> None:
        if self._tables() and self.decisions is not None:
            if not self.decisions.values:
                for path in PATHS:
                    self.decisions.values.setdefault((pool, path), 0.0)
            self.decisions.inc((pool, decision.path))

    def _observe(self, table: HistogramTable | None, record: RequestRecord, seconds: float) -> None:
        if self._tables() and table is not None:
            table.observe((record.pool, record.traffic_class or record.pool), max(0.0, seconds))


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request (vLLM's toy proxy): one token, not streamed, asking the replica to keep the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


async def _off_loop(work: Any, arg: Any, record: RequestRecord) -> Any:
    """JSON work on a long prompt's body (megabytes) in a worker thread, as the coordinator classifies it."""
    if record.extra.get("pd_big"):
        return await asyncio.to_thread(work, arg)
    return work(arg)


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _drop(relay: Any) -> None:
    """A decode stream not handed to the client: closed (vLLM aborts) and its in-flight count released."""
    relay.upstream.close()
    relay.guard.release()


def _is_stream(outcome: Any) -> bool:
    return hasattr(outcome, "first_chunk") and hasattr(outcome, "upstream")


async def _first_token_ok(relay: Any) -> bool:
    """vLLM answers a decode request whose KV could not be loaded with a 200 stream of the role chunk, then an
    error event: read past role-only chunks (they come with the first token) to tell that from a first token."""
    chunk = relay.first_chunk
    while True:
        if b'data: {"error"' in chunk:
            return False
        if not _role_only(chunk):
            return True
        more = await relay.upstream.content.readany()
        if not more:
            return True
        chunk += more
        relay.first_chunk = chunk


def _role_only(chunk: bytes) -> bool:
    events = [e for e in chunk.split(b"\n\n") if e.strip()]
    return bool(events) and all(b'"role"' in e and b'"content":""' in e for e in events)

