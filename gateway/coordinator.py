"""One request's path, start to end: classify → choose a pool → admit → choose a replica → forward → finished.

`Coordinator.serve` is the whole path in one screen; each step below it is a method of a few lines that hands the
decision to a pure policy (`policies/`) over the live state of `Gateway` (`gateway/runtime.py`). Collaborators
plug in without being inlined: traffic control admits (`gateway/admission.py`), precise routing supplies exact
block hashes (`gateway/precise.py`), the relay streams the answer (`gateway/relay.py`), telemetry observes
(`gateway/telemetry.py`). `finished` is the single end of every request, however it ended.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import Admitted, raw_header
from gateway.bodies import check_model, parse_json_object, receive_body
from gateway.disagg import Disaggregation
from gateway.errors import UpstreamFailure, rejected_response
from gateway.record import RequestRecord
from gateway.relay import (
    RETRYABLE_STATUS,
    DisconnectWatch,
    RawResponse,
    StreamRelay,
    response_headers,
    upstream_headers,
    upstream_payload,
    usage_of,
)
from gateway.runtime import Gateway
from policies.admission import RetryLater
from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.estimates import overlength_tokens
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
from pools.replicas import PoolRuntime, Replica

log = logging.getLogger("m3gate")

# Requests whose body is larger than this are classified in a worker thread, off the event loop.
CLASSIFY_IN_THREAD_BYTES = 64 * 1024
_SLO_TTFT_RAW, _SLO_TPOT_RAW = SLO_TTFT_HEADER.encode(), SLO_TPOT_HEADER.encode()
MAX_ATTEMPTS = 2


class Target(NamedTuple):
    """One replica the request may be sent to, and why it was chosen."""

    pool: PoolRuntime
    replica: Replica
    reason: str
    matched_blocks: int
    decision: RoutingDecision | None = None


class Coordinator:
    """Serves the generate endpoints over one `Gateway`'s state."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.disagg = Disaggregation(gateway)  # the P/D path of disaggregated pools (gateway/disagg.py)

    async def serve(self, request: Request, api: str) -> Any:
        """Every outcome is a response: the answer, or an error in OpenAI's shape."""
        gw = self.gw
        record = RequestRecord(api=api, stream=False, t_arrival=gw.clock())
        record.extra["path"] = request.scope["path"]
        gw.telemetry.start(record, request.headers)
        try:
            client = gw.traffic.authenticate(request)  # no key, no body read, no pool
            raw = await receive_body(request, gw.config.server.max_body_bytes, gw.traffic.body_deadline)
            body = parse_json_object(raw)
            check_model(body, gw.served_models)
            gw.traffic.check_input(body, api)
            sessions = gw.sessions
            session = sessions.begin(record, request.scope["headers"], body, api, gw.clock()) if sessions is not None \
                else session_key(request, body)
            profile = await self.classify(body, api, len(raw))
            record.stream = profile.stream
            record.thinking_mode = profile.thinking_mode
            estimated = profile.prompt_tokens
            choice, profile = await self.choose_pool(profile, body, api, request.headers.get("x-m3gate-pool"))
            record.prompt_tokens_est = profile.prompt_tokens
            record.prompt_tokens_raw = 0 if profile.model_counted else estimated
            record.first_pool, record.pool_reason = choice.pool.name, choice.reason
            record.max_tokens = profile.output_budget if profile.budget_explicit else None
            record.t_classified = gw.clock()
            routing = RoutingRequest(
                prompt_tokens=profile.prompt_tokens,
                output_budget=profile.output_budget,
                block_hashes=self.prefix_blocks(body, api),
                session_key=session,
            )
            record.t_routed = gw.clock()
            admitted: Admitted = await gw.traffic.admit(request, record, client, profile, choice)  # may wait
            routing = self.with_slos(request, record, routing)
            payload, strip_usage = upstream_payload(body, raw, api, gw.config.model, profile.stream, admitted.priority)
            return await self.forward(request, record, admitted.choice, profile, routing, payload, strip_usage)
        except RequestRejected as exc:
            record.status, record.error = exc.status, exc.code or exc.type
            await self.finished(record)
            return rejected_response(exc, gw.traffic.refusal_headers(record, exc))
        except UpstreamFailure as exc:
            record.status, record.error = exc.status, exc.code
            await self.finished(record)
            headers = {"retry-after": "1"} if exc.status == 503 else None
            return exc.response(headers)
        except BaseException as exc:  # cancelled, or a gateway bug (→ 500): slot, metrics and span must not leak
            record.status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            record.error = record.error or type(exc).__name__
            await self.finished(record)
            raise

    # 1. classify -------------------------------------------------------------------------------------------
    async def classify(self, body: dict[str, Any], api: str, body_size: int) -> RequestProfile:
        cfg = self.gw.config.classification
        if body_size > CLASSIFY_IN_THREAD_BYTES:
            return await asyncio.to_thread(classify, body, api, cfg, self.gw.counter)
        return classify(body, api, cfg, self.gw.counter)

    # 2. choose a pool --------------------------------------------------------------------------------------
    async def choose_pool(
        self, profile: RequestProfile, body: dict[str, Any], api: str, forced: str | None
    ) -> tuple[PoolChoice, RequestProfile]:
        """The smallest pool that holds the request; near a pool's limit, counted again by the pool's tokenizer."""
        gw = self.gw
        now = gw.clock()
        pools = [p.config for p in gw.pools.values()]
        saturated = frozenset(name for name, p in gw.pools.items() if not p.available(now))
        cfg = gw.config.classification
        choice = choose_pool(profile, pools, cfg, forced=forced, saturated=saturated)
        estimate, ratio = profile, 1.0
        for _ in range(2):  # the estimate as the chosen pool's replicas have been counting (again if that moved it)
            learned = gw.estimates.ratio(choice.pool.name)
            if learned == ratio:
                break
            ratio = learned
            profile = with_learned_ratio(estimate, ratio)
            choice = choose_pool(profile, pools, cfg, forced=forced, saturated=saturated)
        if choice.needs_exact_count and api in ("chat", "completions"):
            exact = await self.exact_prompt_tokens(gw.pools[choice.pool.name], body, api)
            if exact is not None:
                profile = with_exact_prompt_tokens(profile, exact)
                choice = choose_pool(profile, pools, cfg, forced=forced, saturated=saturated)
        return choice, profile

    async def exact_prompt_tokens(self, pool: PoolRuntime, body: dict[str, Any], api: str) -> int | None:
        """Ask one of the pool's replicas to count the prompt with the model's own tokenizer and template."""
        gw = self.gw
        now = gw.clock()
        replicas = [r for r in pool.replicas.values() if r.is_available(now)]
        if not replicas or gw.session is None:
            return None
        if api == "chat":
            payload: dict[str, Any] = {"model": gw.config.model, "messages": body.get("messages")}
            for key in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
                if key in body:
                    payload[key] = body[key]
        else:
            payload = {"model": gw.config.model, "prompt": body.get("prompt")}
        headers = {"content-type": "application/json", **pool.probe_headers()}
        try:
            async with gw.session.post(
                replicas[0].url + "/tokenize", data=orjson.dumps(payload), headers=headers,
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                if resp.status != 200:
                    return None
                data = orjson.loads(await resp.read())
                count = data.get("count")
                return int(count) if isinstance(count, int) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
            return None

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
                pool_routing = routings.get(pool.name, routing) if routings else routing
                decision = gw.policies[pool.name].choose(pool_routing, pool.snapshots(now, gw.shared), now)
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
    ) -> Response | StreamRelay:
        """Send to the chosen replica; before the first byte, a failure is retried once on the next target."""
        gw = self.gw
        assert gw.session is not None
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
        attempt = _Attempts(request, record, payload, strip_usage, profile, heal=choice.reason != "forced")
        watch = gw.watches.watch(request.receive)  # one watcher for the whole request, not a task per await
        try:
            if self.disagg.handles(choice):  # prefill here, decode there; or None: straight to a decode replica
                direct = targets[0].matched_blocks if targets[0].pool.name == choice.pool.name else 0
                pool_routing = routings.get(choice.pool.name, routing)
                answer = await self.disagg.forward(self, attempt, choice, pool_routing, direct, watch)
                if answer is not None:
                    return answer
            last_failure: UpstreamFailure | None = None
            number, reason = 0, None
            while targets:
                target = targets.pop(0)
                outcome = await self._attempt(
                    attempt, number, target, routings.get(target.pool.name, routing), routing,
                    retry_left=bool(targets), watch=watch, reason=reason,
                )
                number += 1
                if isinstance(outcome, list):  # refused as too long: the larger pools' replicas instead
                    targets, reason = outcome, "overlength_retry"
                    continue
                if not isinstance(outcome, UpstreamFailure):
                    return outcome
                last_failure = outcome
            assert last_failure is not None
            raise last_failure
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # we asked for this cancellation; the handler goes on to answer 499
            record.client_disconnected = True
            record.status = 499
            await self.finished(record)
            return Response(status_code=499)
        finally:
            watch.stop()

    async def send(
        self, attempt: _Attempts, number: int, pool: PoolRuntime, replica: Replica, reason: str,
        routing: RoutingRequest, retry_left: bool, watch: DisconnectWatch,
    ) -> Response | StreamRelay | UpstreamFailure | list[Target]:
        """One upstream call on a collaborator's behalf (gateway/disagg.py's decode call), through `_attempt`."""
        return await self._attempt(attempt, number, Target(pool, replica, reason, 0), routing, routing,
                                   retry_left=retry_left, watch=watch, reason=reason, retried=False)

    async def _attempt(
        self, attempt: _Attempts, number: int, target: Target, dispatched_as: RoutingRequest,
        routing: RoutingRequest, retry_left: bool, watch: DisconnectWatch, reason: str | None = None,
        retried: bool | None = None,
    ) -> Response | StreamRelay | UpstreamFailure | list[Target]:
        """One upstream call. Returns the response to send, the failure to retry past, or, when the replica refused
        the prompt as longer than its context and a larger pool can take it, that pool's targets."""
        gw = self.gw
        assert gw.session is not None
        record = attempt.record
        pool, replica = target.pool, target.replica
        record.attempts = number + 1
        record.retried = number > 0 if retried is None else retried
        record.pool, record.replica = pool.name, replica.url
        record.reason = reason or ("retry" if number else target.reason)
        record.matched_blocks = target.matched_blocks
        record.decision = target.decision
        key = pool.config.api_key.get_secret_value() if pool.config.api_key else None
        headers = upstream_headers(attempt.raw_headers, key)
        gw.telemetry.inject(record, headers)
        extra = {"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url, **gw.traffic.response_headers(record)}
        uncached = attempt.profile.prompt_tokens - target.matched_blocks * pool.config.block_size
        guard = replica.guard(attempt.profile.prompt_tokens + attempt.profile.output_budget, max(0, uncached))
        record.t_sent = gw.clock()
        decision = target.decision
        if decision is not None and decision.prefill_plan is not None and decision.replica == replica.url:
            replica.plan_step(record.t_sent, decision.prefill_plan)
        gw.policies[pool.name].dispatched(dispatched_as, replica.url, record.t_sent)
        gw.shared.on_dispatch(pool.name, replica.url, routing)
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await gw.session.post(replica.url + record.extra["path"], data=attempt.payload, headers=headers)
            record.t_headers = gw.clock()
            if upstream.status in RETRYABLE_STATUS and retry_left:
                await upstream.read()
                upstream.release()
                attempt.answered_5xx.append(replica)
                guard.release()
                return UpstreamFailure(502, f"replica answered {upstream.status}", "upstream_error")
            record.status = upstream.status
            is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            if upstream.status < 500:
                # A request every replica answers with a 5xx is the request's fault (one client's odd input must
                # not eject replicas); one another replica serves was the failed replica's.
                for failed in attempt.answered_5xx:
                    failed.record_failure(gw.clock(), answered=True)
                if not is_sse:  # a stream is judged when it ends (`finished`): one broken after its first
                    replica.record_success()  # byte counts against its replica like a failure before it
            if is_sse:
                # Hold the client's 200 back until the first token's event: a replica that dies during
                # prefill is then still retried elsewhere, unseen, instead of breaking a started stream.
                first_chunk = await upstream.content.readany()
                record.t_first_byte = gw.clock()
                guard.first_token()  # its prefill no longer waits ahead of the replica's next requests
                plan = decision.prefill_plan if decision is not None else None
                if plan is not None and first_chunk and decision.replica == replica.url:
                    # the engine cost behind the replica's step clock learns at once, not when the stream ends
                    model = gw.latency.get(pool.name)
                    if model is not None:
                        actual = record.t_first_byte - record.t_sent
                        model.learn_cost(plan[1], actual - plan[0], actual)
                watch.stop()  # the StreamRelay watches for the disconnect from here on
                return StreamRelay(
                    upstream, response_headers(upstream.headers, extra), guard, record,
                    attempt.strip_usage, self.finished, first_chunk=first_chunk,
                )
            try:
                body = await upstream.read()
            finally:
                upstream.release()
                guard.release()
            if upstream.status == 400 and attempt.heal and (larger := self._larger_pool(attempt, pool, body, routing)):
                return larger
            if record.session is not None and gw.sessions is not None:
                gw.sessions.answered(record, body)
            record.t_first_byte = record.t_last_byte = gw.clock()
            if upstream.status == 200 and "content-encoding" not in upstream.headers:
                record.usage = usage_of(body)
            await self.finished(record)
            return RawResponse(upstream.status, response_headers(upstream.headers, extra), body)
        except (aiohttp.ClientError, OSError) as exc:
            guard.release()
            if upstream is not None:
                upstream.release()
            replica.record_failure(gw.clock())
            return UpstreamFailure(
                502, f"replica {replica.url} of pool '{pool.name}' is unreachable ({type(exc).__name__})",
                "upstream_unreachable",
            )
        except asyncio.TimeoutError:
            guard.release()
            if upstream is not None:
                upstream.release()
            replica.record_failure(gw.clock())
            return UpstreamFailure(
                504, f"replica {replica.url} of pool '{pool.name}' did not answer in time", "upstream_timeout"
            )
        except BaseException:
            guard.release()
            if upstream is not None:
                upstream.release()
            raise

    def _larger_pool(
        self, attempt: _Attempts, pool: PoolRuntime, body: bytes, routing: RoutingRequest
    ) -> list[Target] | None:
        """The targets of the smallest larger pool that can hold a prompt this pool's replica refused as too long;
        what the replica counted also teaches the pool's estimate ratio."""
        counted = overlength_tokens(body)
        if counted is None:
            return None
        gw = self.gw
        record = attempt.record
        if counted and record.prompt_tokens_raw:
            self._learn_ratio(pool.name, record.prompt_tokens_raw, counted)
        larger = after_overlength(attempt.profile, [p.config for p in gw.pools.values()], pool.config, counted)
        if larger is None:
            return None
        return self.choose_replicas(larger, replace(routing, prompt_tokens=max(counted, routing.prompt_tokens))) or None

    def _learn_ratio(self, pool: str, estimated: int, counted: int) -> None:
        if self.gw.estimates.observe(pool, estimated, counted):
            log.warning("pool %s: its replicas count %.2f× the gateway's token estimate; pool choice now corrects "
                        "for it (set classification.calibration_factor to match)", pool, self.gw.estimates.ratio(pool))

    # 6. finished -------------------------------------------------------------------------------------------
    async def finished(self, record: RequestRecord) -> None:
        """Called exactly once per request, however it ended: frees its admission slot, feeds latency estimates
        back, then telemetry. Idempotent, so a late error path cannot count a request twice."""
        if record.extra.get("finished"):
            return
        record.extra["finished"] = True
        gw = self.gw
        gw.traffic.finished(record)
        self.disagg.finished(record)
        if record.status == 200 and record.t_first_byte and record.stream:
            pool = gw.pools.get(record.pool)
            replica = pool.replicas.get(record.replica) if pool else None
            if replica is not None:
                if record.client_disconnected:
                    pass  # says nothing about the replica
                elif record.error is None:
                    replica.record_success()
                else:  # the replica broke the stream mid-way: a failure like a 5xx answer (ejects when repeated)
                    replica.record_failure(gw.clock(), answered=True)
                usage = record.usage or {}
                completion = usage.get("completion_tokens") or 0
                prompt = usage.get("prompt_tokens") or record.prompt_tokens_est
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                replica.observe_latency(  # a P/D decode replica pulled its prompt: no prefill rate to learn
                    0 if record.extra.get("pd") else max(0, prompt - cached), record.t_first_byte - record.t_sent,
                    completion, record.t_last_byte - record.t_first_byte,
                )
        if record.status == 200 and record.usage:
            self._learn_from_answer(record, record.usage)
        if record.session is not None and gw.sessions is not None:
            ids = record.trace
            gw.sessions.end(record, (ids.trace_id, ids.span_id) if ids is not None and ids.sampled else None)
        gw.recent.add(record)  # the status page's waterfall (a comparison while no page is open)
        gw.capacity.observe(record)  # demand and decode cost behind the capacity signal
        gw.telemetry.finish(record)

    def _learn_from_answer(self, record: RequestRecord, usage: dict[str, Any]) -> None:
        """What one answer teaches the estimates: the token ratio, the pool's TTFT calibration (a complete stream's
        first token, timed from the send), and the class's output length."""
        gw = self.gw
        counted = usage.get("prompt_tokens")
        if record.prompt_tokens_raw and isinstance(counted, int):
            self._learn_ratio(record.pool, record.prompt_tokens_raw, counted)
        decision = record.decision
        if (decision is not None and decision.features is not None and record.stream and record.t_first_byte
                and record.error is None and not record.client_disconnected and not record.retried):
            calibrator = gw.latency.get(record.pool)
            if calibrator is not None:
                calibrator.learn(decision.features, record.t_first_byte - record.t_sent)
        completion = usage.get("completion_tokens")
        if isinstance(completion, int) and record.error is None:
            gw.output_lengths.observe(record.traffic_class, record.thinking_mode, completion)

    def _sheddable(self, record: RequestRecord) -> bool:
        cls = self.gw.config.traffic.classes.get(record.traffic_class)
        return cls is not None and cls.sheddable


class _Attempts:
    """What every attempt of one request shares: the bytes to send, and the replicas that answered it with a 5xx
    (blamed only if another replica answers this request without one)."""

    __slots__ = ("request", "record", "payload", "strip_usage", "profile", "heal", "raw_headers", "answered_5xx")

    def __init__(self, request: Request, record: RequestRecord, payload: bytes, strip_usage: bool,
                 profile: RequestProfile, heal: bool):
        self.request = request
        self.record = record
        self.payload = payload
        self.strip_usage = strip_usage
        self.profile = profile
        self.heal = heal  # an over-length refusal may be retried in a larger pool (not when the caller forced one)
        self.raw_headers = request.scope["headers"]
        self.answered_5xx: list[Replica] = []


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
