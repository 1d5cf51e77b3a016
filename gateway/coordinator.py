"""One request's path, start to end: classify → choose a pool → admit → choose a replica → forward → finished.

`Coordinator.serve` is the whole path in one screen; each step below it is a method of a few lines that hands the
decision to a pure policy (`policies/`) over the live state of `Gateway` (`gateway/runtime.py`). Collaborators
plug in without being inlined: traffic control admits (`gateway/admission.py`), precise routing supplies exact
block hashes (`gateway/precise.py`), `Upstream` makes each upstream call and says how it went
(`gateway/upstream.py`), the relay streams the answer (`gateway/relay.py`), the P/D path serves disaggregated pools
(`gateway/disagg.py`), `Learning` feeds the estimates (`gateway/learning.py`), telemetry observes
(`gateway/observability/telemetry.py`). `finished` is the single end of every request, however it ended.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import Admitted, fairness_session, raw_header
from gateway.bodies import check_model, parse_json_object, receive_body
from gateway.disagg import Disaggregation
from gateway.errors import UpstreamFailure, rejected_response
from gateway.learning import Learning
from gateway.migration import Resumer, StallWatch
from gateway.record import RequestRecord
from gateway.relay import CollectedAnswer, StreamRelay, upstream_payload
from gateway.runtime import Gateway
from gateway.upstream import Attempt, Failed, Streamed, Target, Upstream, blame_answered_5xx
from policies.admission import RetryLater
from policies.classify import RequestProfile, classify
from policies.config import PoolConfig
from policies.errors import RequestRejected
from policies.estimates import overlength_tokens
from policies.migration import refusal
from policies.pool_choice import (
    PoolChoice,
    after_overlength,
    choose_pool,
    with_exact_prompt_tokens,
    with_learned_ratio,
)
from policies.prefix import prefix_blocks
from policies.replica_choice import NoReplicaAvailable, RoutingDecision, RoutingRequest
from policies.traffic import SLO_TPOT_HEADER, SLO_TTFT_HEADER, request_slos
from policies.vllm_wire import tokenize_body
from pools.replica_tokenize import post_tokenize
from pools.replicas import PoolRuntime, Replica

# Requests whose body is larger than this are classified in a worker thread, off the event loop. Below it the
# coarse token estimate (~0.3 ms) costs less than the hand-off to a thread and back (~0.4 ms of CPU on a 28K-token
# prompt); the body's JSON was parsed on the loop anyway.
CLASSIFY_IN_THREAD_BYTES = 1024 * 1024
_SLO_TTFT_RAW, _SLO_TPOT_RAW = SLO_TTFT_HEADER.encode(), SLO_TPOT_HEADER.encode()
MAX_ATTEMPTS = 2

class Prepared(NamedTuple):
    """A request decided up to its replicas (`Coordinator.prepare`): what a front door sends on."""

    body: dict[str, Any]
    profile: RequestProfile
    choice: PoolChoice  # as admission left it
    routing: RoutingRequest  # with its objectives
    payload: bytes  # the body the replica gets
    strip_usage: bool  # the usage chunk was asked for by the gateway, not the client
    refused: str | None  # why the stream cannot be resumed elsewhere (None: it can, or it is no resumable stream)
    collected: bool = False  # a non-streamed request sent upstream as a stream (policies/collected.py)


class Coordinator:
    """Serves the generate endpoints over one `Gateway`'s state."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.learning = Learning(gateway)  # what answers teach the estimates (gateway/learning.py)
        self.upstream = Upstream(gateway, self.learning, self.finished)  # one upstream call (gateway/upstream.py)
        self.disagg = Disaggregation(gateway, self.upstream)  # the P/D path of disaggregated pools
        # resumable streams gone silent (gateway/migration/)
        self.stalls = StallWatch(gateway.clock, gateway.config.server.health_interval_s)

    async def serve(self, request: Request, api: str) -> Any:
        """Every outcome is a response: the answer, or an error in OpenAI's shape."""
        gw = self.gw
        record = RequestRecord(api=api, stream=False, t_arrival=gw.clock())
        record.path = request.scope["path"]
        gw.telemetry.start(record, request.headers)
        try:
            client = gw.traffic.authenticate(request)  # no key, no body read, no pool
            raw = await receive_body(request, gw.config.server.max_body_bytes, gw.traffic.body_deadline)
            ready = await self.prepare(request, record, client, raw, api)
            resumer = self.resumer(record, ready.body, api, ready.payload, ready.strip_usage, ready.choice,
                                   ready.routing, ready.refused) \
                if (ready.profile.stream or ready.collected) and gw.config.routing.migration.enabled else None
            answer = await self.forward(request, record, ready.choice, ready.profile, ready.routing, ready.payload,
                                        ready.strip_usage, resumer)
            return CollectedAnswer(answer, api) if ready.collected and isinstance(answer, StreamRelay) else answer
        except RequestRejected as exc:
            record.status, record.error = exc.status, exc.code or exc.type
            await self.finished(record)
            return rejected_response(exc, gw.traffic.refusal_headers(record, exc))
        except UpstreamFailure as exc:
            record.status, record.error = exc.status, exc.code
            await self.finished(record)
            headers = gw.traffic.response_headers(record)
            if exc.status == 503:
                headers["retry-after"] = "1"
            return exc.response(headers)
        except BaseException as exc:  # cancelled, or a gateway bug (→ 500): slot, metrics and span must not leak
            record.status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            record.error = record.error or type(exc).__name__
            await self.finished(record)
            raise

    async def prepare(self, request: Request, record: RequestRecord, client: Any, raw: bytes, api: str, *,
                      usage: bool = True, resumable: bool = True) -> Prepared:
        """Both front doors' decisions, in one order (`serve` forwards the result, the endpoint picker hands Envoy
        a pick): input checks, session, classify, choose a pool, admit (may wait), objectives, the upstream body.
        `usage`: a stream asks vLLM for its usage chunk; `resumable`: a stream may be resumed elsewhere, so asks
        for token ids (the picker relays nothing itself: neither)."""
        gw = self.gw
        body = parse_json_object(raw)
        check_model(body, gw.served_models)
        gw.traffic.check_input(body, api)
        sessions = gw.sessions
        session = sessions.begin(record, request.scope["headers"], body, api, gw.clock()) if sessions is not None \
            else session_key(request, body)
        profile = await self.classify(body, api, len(raw))
        record.stream = profile.stream
        record.thinking_mode = profile.thinking_mode
        choice, profile, estimated = await self.choose_pool(profile, body, api, request.headers.get("x-m3gate-pool"),
                                                            len(raw))
        record.prompt_tokens_est = profile.prompt_tokens
        record.prompt_tokens_raw = 0 if profile.model_counted else estimated
        record.first_pool, record.pool_reason = choice.pool.name, choice.reason
        record.max_tokens = profile.output_budget if profile.budget_explicit else None
        record.t_classified = gw.clock()
        blocks = self.prefix_blocks(body, api)
        record.t_routed = gw.clock()
        admitted: Admitted = await gw.traffic.admit(request, record, client, profile, choice, session)  # may wait
        # the output estimate reads the class admission resolved; the pool's fit kept the whole budget
        output = self.learning.expected_output(record, body, profile, client.key_id,
                                               fairness_session(record, client.key_id, session))
        routing = self.with_slos(request, record, RoutingRequest(profile.prompt_tokens, profile.output_budget, blocks,
                                                                 session, output_estimate=output))
        migration = gw.config.routing.migration.enabled
        # a non-streamed background request goes upstream as a stream, so that the lane can pause and resume it
        # (policies/collected.py); its client gets the non-streamed answer put together from it
        collected = resumable and usage and migration and not profile.stream and self._background(record) \
            and refusal(body, api) is None
        stream = profile.stream or collected
        resume = resumable and stream and migration
        refused = refusal(body, api) if resume else None  # "api": Responses and Messages streams carry no ids
        payload, strip_usage = upstream_payload(body, raw, api, gw.config.model, stream and usage,
                                                admitted.priority, token_ids=resume and refused is None,
                                                force_stream=collected)
        return Prepared(body, profile, admitted.choice, routing, payload, strip_usage and not collected, refused,
                        collected)

    def _background(self, record: RequestRecord) -> bool:
        cfg = self.gw.config.traffic.classes.get(record.traffic_class)
        return cfg is not None and cfg.background

    # 1. classify -------------------------------------------------------------------------------------------
    async def classify(self, body: dict[str, Any], api: str, body_size: int, precise: bool = False) -> RequestProfile:
        cfg = self.gw.config.classification
        if body_size > CLASSIFY_IN_THREAD_BYTES:
            return await asyncio.to_thread(classify, body, api, cfg, self.gw.counter, precise)
        return classify(body, api, cfg, self.gw.counter, precise)

    # 2. choose a pool --------------------------------------------------------------------------------------
    async def choose_pool(
        self, profile: RequestProfile, body: dict[str, Any], api: str, forced: str | None, body_size: int
    ) -> tuple[PoolChoice, RequestProfile, int]:
        """The smallest pool that holds the request; near a pool's limit, estimated again from the full sample
        (when the first estimate was coarse), then, if still near, counted by the pool's tokenizer. Also returns
        the gateway's own estimate the choice rests on (before the pool's learned ratio)."""
        gw = self.gw
        now = gw.clock()
        pools = [p.config for p in gw.pools.values()]
        saturated = frozenset(name for name, p in gw.pools.items() if not p.available(now))
        choice, fitted = self._fit(profile, pools, forced, saturated)
        if choice.needs_exact_count and profile.estimate_refinable:
            profile = await self.classify(body, api, body_size, precise=True)
            choice, fitted = self._fit(profile, pools, forced, saturated)
        if choice.needs_exact_count and api in ("chat", "completions"):
            exact = await self.exact_prompt_tokens(gw.pools[choice.pool.name], body, api)
            if exact is not None:
                fitted = with_exact_prompt_tokens(fitted, exact)
                choice = choose_pool(fitted, pools, gw.config.classification, forced=forced, saturated=saturated)
        return choice, fitted, profile.prompt_tokens

    def _fit(self, profile: RequestProfile, pools: list[PoolConfig], forced: str | None,
             saturated: frozenset[str]) -> tuple[PoolChoice, RequestProfile]:
        """The pool choice for the estimate as the chosen pool's replicas have been counting (`Learning`'s ratio;
        again if that moved it), and the estimate so corrected."""
        cfg = self.gw.config.classification
        choice = choose_pool(profile, pools, cfg, forced=forced, saturated=saturated)
        fitted, ratio = profile, 1.0
        for _ in range(2):
            learned = self.gw.estimates.ratio(choice.pool.name)
            if learned == ratio:
                break
            ratio = learned
            fitted = with_learned_ratio(profile, ratio)
            choice = choose_pool(fitted, pools, cfg, forced=forced, saturated=saturated)
        return choice, fitted

    async def exact_prompt_tokens(self, pool: PoolRuntime, body: dict[str, Any], api: str) -> int | None:
        """Ask one of the pool's replicas to count the prompt with the model's own tokenizer and template."""
        gw = self.gw
        now = gw.clock()
        replicas = [r for r in pool.replicas.values() if r.is_available(now)]
        if not replicas or gw.session is None:
            return None
        payload = tokenize_body(body, api, gw.config.model)
        if payload is None:
            return None
        answer = await post_tokenize(gw.session, replicas[0].url, orjson.dumps(payload), pool.probe_headers())
        return answer.count()

    def prefix_blocks(self, body: dict[str, Any], api: str) -> tuple[int, ...]:
        """Chained prefix-block hashes, only computed when the routing policy reads them."""
        if self.gw.config.routing.policy != "prefix_affinity":
            return ()
        return prefix_blocks(body, api, self.gw.config.model)

    # 3. admit: gateway/admission.py's TrafficControl.admit; then the objectives the class or caller set
    def with_slos(self, request: Request, record: RequestRecord, routing: RoutingRequest) -> RoutingRequest:
        """The routing request with its TTFT/TPOT objectives, when any apply (x-slo-* headers, or the class's target
        with routing.slo_aware on)."""
        raw = request.scope["headers"]  # read raw: Starlette's Headers costs ~0.5 µs per absent name
        ttft_ms, tpot_ms = raw_header(raw, _SLO_TTFT_RAW), raw_header(raw, _SLO_TPOT_RAW)
        aware = self.gw.config.routing.slo_aware
        if ttft_ms is None and tpot_ms is None and not aware:
            return routing
        ttft, tpot = request_slos(ttft_ms, tpot_ms, self.gw.config.traffic, record.traffic_class, aware)
        record.ttft_slo_s = ttft
        return replace(routing, ttft_slo_s=ttft, tpot_slo_s=tpot) if ttft is not None or tpot is not None else routing

    # 4. choose replicas ------------------------------------------------------------------------------------
    def choose_replicas(
        self, choice: PoolChoice, routing: RoutingRequest, routings: Mapping[str, RoutingRequest] | None = None
    ) -> list[Target]:
        """Up to MAX_ATTEMPTS targets: the best replica, then the next best in the same pool, else the best of the
        next larger pool. `routings`: per pool, the request with that pool's exact block hashes (precise pools).

        With an SLO, a pool whose best replica is predicted to miss it yields to the first larger candidate pool
        predicted to meet it ("slo_spill"); when none is, the request goes where it would have ("slo_expected_miss")."""
        gw = self.gw
        now = gw.clock()
        targets: list[Target] = []
        missing: list[Target] = []  # from pools predicted to miss the SLO: tried after any pool that meets it
        for pool_cfg in choice.candidates:
            pool = gw.pools.get(pool_cfg.name)
            if pool is None:  # removed by a reload while the request waited
                continue
            try:
                decision = self._decide(pool, routings.get(pool.name, routing) if routings else routing, now)
            except NoReplicaAvailable:
                continue
            found = [
                Target(pool, replica, decision.reason, decision.matched_blocks, decision)
                for url in (decision.replica, *decision.fallbacks)
                if (replica := pool.replicas.get(url)) is not None and replica.is_available(now)
            ][:MAX_ATTEMPTS]
            if not found:
                continue
            if decision.slo_met is False:
                missing.extend(found)
                continue
            if missing and not targets:
                found[0] = found[0]._replace(reason="slo_spill")
            targets.extend(found)
            if len(targets) >= MAX_ATTEMPTS:
                break
        if missing and not targets:
            missing[0] = missing[0]._replace(reason="slo_expected_miss")
        return (targets + missing)[:MAX_ATTEMPTS]

    def _decide(self, pool: PoolRuntime, routing: RoutingRequest, now: float) -> RoutingDecision:
        """The pool policy's decision, over the replicas it shortlists in a large pool (`PrefixAffinity.shortlist`:
        the decision's cost does not grow with the pool), or over all of them; all of them as well when none of the
        shortlisted can take it or all of them are saturated (the rest of the pool may not be)."""
        gw = self.gw
        policy = gw.policies[pool.name]
        shortlist = getattr(policy, "shortlist", None)
        if shortlist is not None and not pool.disaggregated:
            only = shortlist(routing, pool.replicas)
            if only is not None:
                try:
                    decision = policy.choose(routing, pool.snapshots_of(only, now, gw.shared), now)
                    if decision.reason != "all_saturated":
                        return decision
                except NoReplicaAvailable:
                    pass
        return policy.choose(routing, pool.snapshots(now, gw.shared), now)

    async def pick(
        self, record: RequestRecord, choice: PoolChoice, routing: RoutingRequest, payload: bytes
    ) -> tuple[list[Target], Mapping[str, RoutingRequest]]:
        """The targets to try, in order, and per pool the request as precise routing saw it: what `forward` sends to,
        and what the endpoint picker (gateway/epp/picker.py) hands Envoy. Raises 503 (no replica) or 429 (shed)."""
        gw = self.gw
        routings = await gw.precise.routings(choice, routing, payload, record.api, gw.pools) if gw.precise else {}
        targets = self.choose_replicas(choice, routing, routings)
        if not targets:
            raise UpstreamFailure(
                503,
                f"No healthy replica in pool '{choice.pool.name}' or any larger pool it may spill to; retry shortly.",
                "no_healthy_replica",
            )
        if targets[0].reason == "slo_expected_miss" and self._sheddable(record):
            raise _shed(record, targets[0])
        return targets, routings

    # 5. forward --------------------------------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        record: RequestRecord,
        choice: PoolChoice,
        profile: RequestProfile,
        routing: RoutingRequest,
        payload: bytes,
        strip_usage: bool,
        resumer: Resumer | None = None,
    ) -> Response | StreamRelay:
        """Send to the chosen replica; before the first byte, a failure is retried once on the next target; after
        it, `resumer` resumes the stream on another replica."""
        gw = self.gw
        targets, routings = await self.pick(record, choice, routing, payload)
        # one disconnect watcher for the whole request, not a task per await
        attempt = Attempt(request, record, profile, strip_usage, gw.watches.watch(request.receive), resumer=resumer)
        try:
            if self.disagg.handles(choice):  # prefill here, decode there; or None: straight to a decode replica
                direct = targets[0].matched_blocks if targets[0].pool.name == choice.pool.name else 0
                answer = await self.disagg.forward(attempt, choice, routings.get(choice.pool.name, routing), direct,
                                                   payload)
                if answer is not None:
                    return answer
            return await self._try(attempt, targets, payload, routing, routings, heal=choice.reason != "forced")
        except asyncio.CancelledError:
            if not attempt.watch.disconnected:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # we asked for this cancellation; the handler goes on to answer 499
            record.client_disconnected = True
            record.status = 499
            await self.finished(record)
            return Response(status_code=499)
        finally:
            attempt.watch.stop()

    async def _try(
        self, attempt: Attempt, targets: list[Target], payload: bytes, routing: RoutingRequest,
        routings: Mapping[str, RoutingRequest], heal: bool,
    ) -> Response | StreamRelay:
        """The targets in turn until one answers. A prompt a replica refuses as longer than its context goes on to
        the smallest larger pool that holds it (`heal`: not when the caller forced the pool)."""
        last: Failed | None = None
        number, reason = 0, None
        while targets:
            target = targets.pop(0)
            if number:
                target = target._replace(reason=reason or "retry")
            outcome = await self.upstream.send(
                attempt, target, payload, routing, number=number, retried=number > 0, retry_left=bool(targets),
                dispatched_as=routings.get(target.pool.name, routing),
            )
            number += 1
            if isinstance(outcome, Failed):
                if outcome.kind == "answered_5xx":
                    attempt.answered_5xx.append(target.replica)
                last = outcome
                continue
            blame_answered_5xx(attempt.answered_5xx, attempt.record.status, self.gw.clock())
            if isinstance(outcome, Streamed):
                return outcome.relay
            if outcome.status == 400 and heal and (larger := self._larger_pool(attempt, target.pool, outcome.body,
                                                                               routing)):
                targets, reason = larger, "overlength_retry"
                continue
            return await self.upstream.complete(attempt.record, outcome)
        assert last is not None
        raise last.error()

    def _larger_pool(
        self, attempt: Attempt, pool: PoolRuntime, body: bytes, routing: RoutingRequest
    ) -> list[Target] | None:
        """The targets of the smallest larger pool that can hold a prompt this pool's replica refused as too long;
        what the replica counted also teaches the pool's estimate ratio."""
        counted = overlength_tokens(body)
        if counted is None:
            return None
        self.learning.overlength(pool.name, attempt.record, counted)
        larger = after_overlength(attempt.profile, [p.config for p in self.gw.pools.values()], pool.config, counted)
        if larger is None:
            return None
        return self.choose_replicas(larger, replace(routing, prompt_tokens=max(counted, routing.prompt_tokens))) or None

    # a stream broken after its first byte ---------------------------------------------------------------------
    def resumer(self, record: RequestRecord, body: dict[str, Any], api: str, payload: bytes, strip_usage: bool,
                choice: PoolChoice, routing: RoutingRequest, refused: str | None) -> Resumer:
        """How this request's stream is resumed on another replica if its replica fails after the first byte
        (gateway/migration/), or counted refused when it cannot be (`refused`: why)."""
        cfg = self.gw.config.routing.migration
        return Resumer(self.gw, record, body, api, payload, include_usage=not strip_usage,
                       choose=lambda failed: self.resume_targets(choice, routing, failed),
                       send_leg=lambda target, path, payload, tokens: self.upstream.resume(
                           record, target, routing, path, payload, tokens),
                       stall_timeout_s=cfg.stall_timeout_s, max_migrations=cfg.max_migrations, watch=self.stalls,
                       refused=refused)

    def resume_targets(self, choice: PoolChoice, routing: RoutingRequest, exclude: set[str]) -> list[Target]:
        """Where a broken stream may go on: the pool's own choice first, then any other available replica of the
        pool, then the larger pools', never a replica in `exclude` (those that failed it) nor a prefill replica."""
        gw = self.gw
        now = gw.clock()
        out: list[Target] = []
        for pool_cfg in choice.candidates:
            pool = gw.pools.get(pool_cfg.name)
            if pool is None:
                continue
            try:
                decision = gw.policies[pool.name].choose(routing, pool.snapshots(now, gw.shared), now)
                urls = [decision.replica, *decision.fallbacks, *pool.replicas]
            except NoReplicaAvailable:
                decision, urls = None, list(pool.replicas)
            for url in dict.fromkeys(urls):
                replica = pool.replicas.get(url)
                if replica is not None and url not in exclude and replica.is_available(now) \
                        and replica.role != "prefill":
                    out.append(Target(pool, replica, "migration", 0, decision))
        return out

    # 6. finished -------------------------------------------------------------------------------------------
    async def finished(self, record: RequestRecord) -> None:
        """Called exactly once per request, however it ended: frees its admission slot, judges and learns from its
        answer, then telemetry. Idempotent, so a late error path cannot count a request twice."""
        if record.done:
            return
        record.done = True
        gw = self.gw
        gw.traffic.finished(record)
        self.disagg.finished(record)
        replica = self._judge_stream(record)
        # a resumed stream's timings span two replicas and a seam: its replica's latency is not learnt from them
        self.learning.finished(record, None if record.t_cut else replica)
        if record.session is not None and gw.sessions is not None:
            ids = record.trace
            gw.sessions.end(record, (ids.trace_id, ids.span_id) if ids is not None and ids.sampled else None)
        gw.recent.add(record)  # the status page's waterfall (a comparison while no page is open)
        gw.capacity.observe(record)  # demand and decode cost behind the capacity signal
        gw.telemetry.finish(record)

    def _judge_stream(self, record: RequestRecord) -> Replica | None:
        """A stream that started is judged by how it ended: its replica, to learn its latency from, or None."""
        if record.status != 200 or not record.t_first_byte or not record.stream:
            return None
        pool = self.gw.pools.get(record.pool)
        replica = pool.replicas.get(record.replica) if pool else None
        if replica is None or record.client_disconnected:  # a client gone says nothing about the replica
            return replica
        if record.error is None:
            replica.record_success()
        else:  # the replica broke the stream mid-way: a failure like a 5xx answer (ejects when repeated)
            replica.record_failure(self.gw.clock(), answered=True)
        return replica

    def _sheddable(self, record: RequestRecord) -> bool:
        cls = self.gw.config.traffic.classes.get(record.traffic_class)
        return cls is not None and cls.sheddable


def _shed(record: RequestRecord, target: Target) -> RetryLater:
    """The 429 for a sheddable request no replica is predicted to serve within its objective; Retry-After is the
    predicted excess, at least a second."""
    predicted = target.decision.predicted_ttft_p90_s if target.decision is not None else None
    slo = record.ttft_slo_s
    record.reason = "slo_expected_miss"
    wait = max(1, math.ceil((predicted or 0.0) - (slo or 0.0)))
    if slo is not None and predicted is not None:
        message = (f"No replica is predicted to answer within this request's time-to-first-token objective "
                   f"({slo * 1000:.0f} ms; the best predicted P90 is {predicted * 1000:.0f} ms) and its traffic "
                   f"class is sheddable; retry in {wait} s (Retry-After) or relax the objective.")
    else:
        message = ("No replica is predicted to meet this request's latency objective and its traffic class is "
                   f"sheddable; retry in {wait} s (Retry-After) or relax the objective.")
    return RetryLater(message, status=429, code="slo_unattainable", retry_after_s=wait)


def session_key(request: Request, body: dict[str, Any]) -> str | None:
    """The sticky-session key: the `x-session-id` header, else the body's `user`."""
    key = request.headers.get("x-session-id")
    if key:
        return key
    user = body.get("user")
    return user if isinstance(user, str) and user else None
