"""The gateway's runtime (`Gateway`) and its Starlette app.

One request's path: `routes.generate` parses the body → `Gateway.classify` (policies/classify) → `Gateway.choose_pool`
(policies/pool_choice, with an exact /tokenize count near a boundary) → `Gateway.forward`: replica choice
(policies/replica_choice over snapshots) and the upstream call (gateway/relay), retried once before the first byte.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import TrafficControl
from gateway.errors import UpstreamFailure
from gateway.discovery import DiscoveryManager
from gateway.telemetry import Telemetry
from gateway.relay import (
    RETRYABLE_STATUS,
    RequestRecord,
    StreamRelay,
    DisconnectWatches,
    response_headers,
    upstream_headers,
)
from policies.admission import pool_saturated
from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.pool_choice import PoolChoice, choose_pool, with_exact_prompt_tokens
from policies.prefix import prefix_blocks
from policies.replica_choice import NoReplicaAvailable, ReplicaPolicy, RoutingRequest, build_policy
from policies.tokens import TokenCounter
from pools.config import GatewayConfig
from pools.kv_events import PreciseCollector, PrecisePool
from pools.monitor import ReplicaMonitor
from pools.prefix_index import PrefixIndex
from pools.shared_state import SharedState, build_shared_state
from pools.replicas import PoolRuntime, Replica

log = logging.getLogger("m3gate")

# Requests whose body is larger than this are classified in a worker thread, off the event loop.
CLASSIFY_IN_THREAD_BYTES = 64 * 1024
MAX_ATTEMPTS = 2


class Gateway:
    """Everything one gateway process knows: config, pools and replicas, policies, the upstream session."""

    def __init__(self, config: GatewayConfig, clock: Any = time.monotonic, resolver: Any = None) -> None:
        self.config = config
        self.clock = clock
        self.counter = TokenCounter(config.classification)
        self.pools: dict[str, PoolRuntime] = {}
        self.policies: dict[str, ReplicaPolicy] = {}
        self.prefix_index = PrefixIndex()
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self.monitor: ReplicaMonitor | None = None
        self.precise: dict[str, PrecisePool] = {}  # pools routing from their replicas' KV events
        self._precise_tasks: set[asyncio.Task[None]] = set()  # starts and stops after reloads, kept referenced
        self.watches = DisconnectWatches()
        self._apply_config(config)
        self.telemetry = Telemetry(self)
        self._register_precise_metrics()
        self.discovery = DiscoveryManager(self, resolver)
        self.shared: SharedState = build_shared_state(
            config.state, self._apply_remote_dispatch, self._local_in_flight, model=config.model
        )
        self.traffic = TrafficControl(config, clock, self.pool_saturated)

    # lifecycle ---------------------------------------------------------------------------------------------
    def _apply_config(self, config: GatewayConfig) -> None:
        previous = self.pools
        policy_changed = config.routing != self.config.routing
        self.config = config
        self.pools = {p.name: PoolRuntime.from_config(p, previous.get(p.name)) for p in config.pools_by_size()}
        rebuilt = self._configure_precise(config)
        self.policies = {
            name: (None if policy_changed or name in rebuilt else self.policies.get(name))
            or build_policy(config.routing.policy, prefix_index=self._prefix_matcher(name),
                            **_policy_params(config))
            for name in self.pools
        }
        self._served = frozenset(config.served_model_ids())
        self.sync_prefix_index()

    def sync_prefix_index(self) -> None:
        """Bound each replica's prefix index by its KV capacity; forget replicas that left the config."""
        self.prefix_index.sync({r.url: r.kv_blocks for r in self.all_replicas()})
        self.sync_precise()

    def apply_config(self, config: GatewayConfig) -> list[str]:
        """Swap in a validated config. Kept endpoints keep their state; requests in flight on removed ones finish.
        Returns notes about settings that only take effect on restart."""
        old = self.config
        notes = []
        if config.server.host != old.server.host or config.server.port != old.server.port:
            notes.append("server.host/port changes take effect on restart")
        if config.state != old.state:
            notes.append("`state` changes take effect on restart")
        if config.classification.encoding != old.classification.encoding:
            self.counter = TokenCounter(config.classification)
        self._apply_config(config)
        notes.extend(self.traffic.apply_config(config))
        if self.telemetry.apply_config(config):  # metrics turned on by this reload: a fresh registry
            self._register_precise_metrics()
        return notes

    def telemetry_reload(self, ok: bool) -> None:
        hook = getattr(self.telemetry, "config_reloaded", None)
        if hook is not None:
            hook(ok)

    async def start(self) -> None:
        server = self.config.server
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=10, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # replicas set no cookies; a real jar filters them per request
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=server.upstream_connect_timeout_s, sock_read=server.upstream_read_timeout_s
            ),
        )
        self.monitor = ReplicaMonitor(
            self.session, self.all_replicas, server.health_interval_s, headers_for=self._probe_headers,
            clock=self.clock, on_capacity=self.sync_prefix_index,
        )
        self.watches.start()
        await self.discovery.sync()
        await self.monitor.poll_once()
        self.monitor.start()
        await self.shared.start()
        await self.traffic.start()
        await self._start_precise()

    async def stop(self) -> None:
        await self.watches.stop()
        await self._stop_precise()
        await self.discovery.stop()
        await self.traffic.stop()
        await self.shared.stop()
        if self.monitor:
            await self.monitor.stop()
        if self.session:
            await self.session.close()
        await self.telemetry.shutdown()

    def all_replicas(self) -> list[Replica]:
        return [r for pool in self.pools.values() for r in pool.replicas.values()]

    def _apply_remote_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        """Another gateway sent `request` to `replica`: learn it as if this gateway had (prefix index, sessions)."""
        policy = self.policies.get(pool)
        if policy is not None and replica in self.pools[pool].replicas:
            policy.dispatched(request, replica, self.clock())

    def pool_saturated(self, name: str) -> bool:
        """Every available replica of the pool reports a long vLLM queue or a full KV cache (admission waits)."""
        pool = self.pools.get(name)
        if pool is None:
            return False
        return pool_saturated(pool.snapshots(self.clock(), self.shared), self.config.traffic.saturation)

    def _local_in_flight(self) -> dict[str, int]:
        return {r.url: r.in_flight for r in self.all_replicas()}

    def _probe_headers(self, replica: Replica) -> dict[str, str]:
        key = self.pools[replica.pool].config.api_key if replica.pool in self.pools else None
        return {"authorization": f"Bearer {key.get_secret_value()}"} if key else {}

    # classification ----------------------------------------------------------------------------------------
    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise RequestRejected("`model` must be a string", param="model", code="invalid_type")
        if model not in self._served:
            raise RequestRejected(
                f"The model `{model}` does not exist. This gateway serves: {', '.join(sorted(self._served))}.",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def classify(self, body: dict[str, Any], api: str, body_size: int) -> RequestProfile:
        cfg = self.config.classification
        if body_size > CLASSIFY_IN_THREAD_BYTES:
            return await asyncio.to_thread(classify, body, api, cfg, self.counter)
        return classify(body, api, cfg, self.counter)

    async def choose_pool(
        self, profile: RequestProfile, body: dict[str, Any], api: str, forced: str | None
    ) -> tuple[PoolChoice, RequestProfile]:
        now = self.clock()
        pools = [p.config for p in self.pools.values()]
        saturated = frozenset(name for name, p in self.pools.items() if not p.available(now))
        cfg = self.config.classification
        choice = choose_pool(profile, pools, cfg, forced=forced, saturated=saturated)
        if choice.needs_exact_count and api in ("chat", "completions"):
            exact = await self.exact_prompt_tokens(self.pools[choice.pool.name], body, api)
            if exact is not None:
                profile = with_exact_prompt_tokens(profile, exact)
                choice = choose_pool(profile, pools, cfg, forced=forced, saturated=saturated)
        return choice, profile

    async def exact_prompt_tokens(self, pool: PoolRuntime, body: dict[str, Any], api: str) -> int | None:
        """Ask one of the pool's replicas to count the prompt with the model's own tokenizer and template."""
        now = self.clock()
        replicas = [r for r in pool.replicas.values() if r.is_available(now)]
        if not replicas or self.session is None:
            return None
        if api == "chat":
            payload: dict[str, Any] = {"model": self.config.model, "messages": body.get("messages")}
            for key in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
                if key in body:
                    payload[key] = body[key]
        else:
            payload = {"model": self.config.model, "prompt": body.get("prompt")}
        headers = {"content-type": "application/json", **self._probe_headers(replicas[0])}
        try:
            async with self.session.post(
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
        if self.config.routing.policy != "prefix_affinity":
            return ()
        return prefix_blocks(body, api, self.config.model)

    # precise prefix routing (pools/kv_events.py) ---------------------------------------------------------
    def _configure_precise(self, config: GatewayConfig) -> set[str]:
        """Keep one PrecisePool per pool with `precise` on (prefix_affinity only); returns the pools whose matcher
        changed (their policies are rebuilt). A pool whose precise settings changed gets a fresh one."""
        wanted = {
            p.name: p for p in config.pools
            if p.precise is not None and p.precise.enabled and config.routing.policy == "prefix_affinity"
        }
        changed: set[str] = set()
        for name in [n for n in self.precise if n not in wanted]:
            self._retire_precise(self.precise.pop(name))
            changed.add(name)
        for name, pool_cfg in wanted.items():
            current = self.precise.get(name)
            if current is not None and current.identity == PrecisePool.identity_for(pool_cfg, config.model):
                continue
            if current is not None:
                self._retire_precise(current)
            fresh = PrecisePool(pool_cfg, config.model, self.prefix_index, self.clock)
            self.precise[name] = fresh
            changed.add(name)
            if self.session is not None:  # running: a reload turned it on
                pool = self.pools.get(name)
                replicas = list(pool.replicas.values()) if pool is not None else []
                self._precise_task(fresh.start(self.session, self._probe_headers(replicas[0]) if replicas else {}))
        return changed

    def _retire_precise(self, precise: PrecisePool) -> None:
        self._precise_task(precise.stop())

    def _precise_task(self, work: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no running loop (built before start): nothing was started, nothing to stop
            work.close()
            return
        self._precise_tasks.add(task)
        task.add_done_callback(self._precise_tasks.discard)

    def _prefix_matcher(self, pool: str) -> Any:
        precise = self.precise.get(pool)
        return precise.matcher if precise is not None else self.prefix_index

    def sync_precise(self) -> None:
        """Subscribe to the KV events of exactly the precise pools' current replicas (config, discovery, reload)."""
        for name, precise in self.precise.items():
            pool = self.pools.get(name)
            replicas = list(pool.replicas.values()) if pool is not None else []
            headers = self._probe_headers(replicas[0]) if replicas else {}
            precise.hub.sync(precise.targets(replicas, headers))

    async def _start_precise(self) -> None:
        assert self.session is not None
        for name, precise in self.precise.items():
            replicas = list(self.pools[name].replicas.values())
            await precise.start(self.session, self._probe_headers(replicas[0]) if replicas else {})

    async def _stop_precise(self) -> None:
        for precise in self.precise.values():
            await precise.stop()

    def _register_precise_metrics(self) -> None:
        metrics = getattr(self.telemetry, "metrics", None)
        if metrics is not None:
            metrics.registry.register(PreciseCollector(
                _PreciseHubs(self), lambda: {n: p.matcher for n, p in self.precise.items()},
                lambda: {n: p.hasher for n, p in self.precise.items() if p.hasher is not None},
            ))

    async def precise_routings(
        self, choice: PoolChoice, routing: RoutingRequest, payload: bytes, api: str
    ) -> dict[str, RoutingRequest]:
        """The request with its exact vLLM block hashes, for each candidate pool that routes precisely (pools that
        hash alike share one computation). Tokenizing runs in a worker thread; a failure means approximate routing."""
        out: dict[str, RoutingRequest] = {}
        done: dict[Any, tuple[int, ...]] = {}
        now = self.clock()
        for pool_cfg in choice.candidates:
            precise = self.precise.get(pool_cfg.name)
            pool = self.pools.get(pool_cfg.name)
            if precise is None or pool is None or precise.hasher is None:
                continue
            key = (precise.hash_settings, precise.config.tokenizer, precise.config.model_dir)
            if key not in done:
                replica = next((r.url for r in pool.replicas.values() if r.is_available(now)), None)
                done[key] = await precise.exact_hashes(payload, api, replica)
            if done[key]:
                out[pool_cfg.name] = replace(routing, exact_block_hashes=done[key])
        return out

    # forwarding --------------------------------------------------------------------------------------------
    def _targets(
        self, choice: PoolChoice, routing: RoutingRequest, routings: Mapping[str, RoutingRequest] | None = None
    ) -> list[tuple[PoolRuntime, Replica, str, int]]:
        """Up to MAX_ATTEMPTS (pool, replica, reason, matched blocks): the best replica, then the next best in
        the same pool, else the best of the next larger pool. `routings`: per pool, the request with that pool's
        exact block hashes (precise pools)."""
        now = self.clock()
        targets: list[tuple[PoolRuntime, Replica, str, int]] = []
        for pool_cfg in choice.candidates:
            pool = self.pools.get(pool_cfg.name)
            if pool is None:  # removed by a reload while the request waited
                continue
            try:
                pool_routing = routings.get(pool.name, routing) if routings else routing
                decision = self.policies[pool.name].choose(pool_routing, pool.snapshots(now, self.shared), now)
            except NoReplicaAvailable:
                continue
            for url in (decision.replica, *decision.fallbacks):
                replica = pool.replicas.get(url)
                if replica is not None and replica.is_available(now):
                    targets.append((pool, replica, decision.reason, decision.matched_blocks))
                    if len(targets) >= MAX_ATTEMPTS:
                        return targets
        return targets

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
        assert self.session is not None
        routings = await self.precise_routings(choice, routing, payload, record.api) if self.precise else {}
        targets = self._targets(choice, routing, routings)
        if not targets:
            raise UpstreamFailure(
                503,
                f"No healthy replica in pool '{choice.pool.name}' or any larger pool it may spill to; retry shortly.",
                "no_healthy_replica",
            )
        raw_headers = request.scope["headers"]
        tokens = profile.prompt_tokens + profile.output_budget
        last_failure: UpstreamFailure | None = None
        answered_5xx: list[Replica] = []  # blamed only if another replica answers this request without a 5xx
        watch = self.watches.watch(request.receive)  # one watcher for the whole request, not a task per await
        try:
            for attempt, (pool, replica, reason, matched) in enumerate(targets):
                record.attempts = attempt + 1
                record.retried = attempt > 0
                record.pool, record.replica = pool.name, replica.url
                record.reason = "retry" if attempt else reason
                record.matched_blocks = matched
                key = pool.config.api_key.get_secret_value() if pool.config.api_key else None
                headers = upstream_headers(raw_headers, key)
                self.telemetry.inject(record, headers)
                extra = {"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url,
                         **self.traffic.response_headers(record)}
                guard = replica.guard(tokens)
                record.t_sent = self.clock()
                self.policies[pool.name].dispatched(routings.get(pool.name, routing), replica.url, record.t_sent)
                self.shared.on_dispatch(pool.name, replica.url, routing)
                upstream: aiohttp.ClientResponse | None = None
                try:
                    upstream = await self.session.post(replica.url + record.extra["path"], data=payload, headers=headers)
                    record.t_headers = self.clock()
                    if upstream.status in RETRYABLE_STATUS and attempt + 1 < len(targets):
                        await upstream.read()
                        upstream.release()
                        answered_5xx.append(replica)
                        guard.release()
                        last_failure = UpstreamFailure(502, f"replica answered {upstream.status}", "upstream_error")
                        continue
                    record.status = upstream.status
                    is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
                    if upstream.status < 500:
                        # A request every replica answers with a 5xx is the request's fault (one client's odd input must
                        # not eject replicas); one another replica serves was the failed replica's.
                        for failed in answered_5xx:
                            failed.record_failure(self.clock(), answered=True)
                        if not is_sse:  # a stream is judged when it ends (`finished`): one broken after its first
                            replica.record_success()  # byte counts against its replica like a failure before it
                    if is_sse:
                        # Hold the client's 200 back until the first token's event: a replica that dies during
                        # prefill is then still retried elsewhere, unseen, instead of breaking a started stream.
                        first_chunk = await upstream.content.readany()
                        record.t_first_byte = self.clock()
                        watch.stop()  # the StreamRelay watches for the disconnect from here on
                        return StreamRelay(
                            upstream, response_headers(upstream.headers, extra), guard, record,
                            strip_usage, self.finished, first_chunk=first_chunk,
                        )
                    try:
                        body = await upstream.read()
                    finally:
                        upstream.release()
                        guard.release()
                    record.t_first_byte = record.t_last_byte = self.clock()
                    if upstream.status == 200 and "content-encoding" not in upstream.headers:
                        record.usage = _usage_of(body)
                    await self.finished(record)
                    return _RawResponse(upstream.status, response_headers(upstream.headers, extra), body)
                except (aiohttp.ClientError, OSError) as exc:
                    guard.release()
                    if upstream is not None:
                        upstream.release()
                    replica.record_failure(self.clock())
                    last_failure = UpstreamFailure(
                        502, f"replica {replica.url} of pool '{pool.name}' is unreachable ({type(exc).__name__})",
                        "upstream_unreachable",
                    )
                except asyncio.TimeoutError:
                    guard.release()
                    if upstream is not None:
                        upstream.release()
                    replica.record_failure(self.clock())
                    last_failure = UpstreamFailure(
                        504, f"replica {replica.url} of pool '{pool.name}' did not answer in time", "upstream_timeout"
                    )
                except BaseException:
                    guard.release()
                    if upstream is not None:
                        upstream.release()
                    raise
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

    async def finished(self, record: RequestRecord) -> None:
        """Called exactly once per request, however it ended: frees its admission slot, feeds latency estimates
        back, then telemetry. Idempotent, so a late error path cannot count a request twice."""
        if record.extra.get("finished"):
            return
        record.extra["finished"] = True
        self.traffic.finished(record)
        if record.status == 200 and record.t_first_byte and record.stream:
            pool = self.pools.get(record.pool)
            replica = pool.replicas.get(record.replica) if pool else None
            if replica is not None:
                if record.client_disconnected:
                    pass  # says nothing about the replica
                elif record.error is None:
                    replica.record_success()
                else:  # the replica broke the stream mid-way: a failure like a 5xx answer (ejects when repeated)
                    replica.record_failure(self.clock(), answered=True)
                usage = record.usage or {}
                completion = usage.get("completion_tokens") or 0
                prompt = usage.get("prompt_tokens") or record.prompt_tokens_est
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                replica.observe_latency(
                    max(0, prompt - cached), record.t_first_byte - record.t_sent,
                    completion, record.t_last_byte - record.t_first_byte,
                )
        self.telemetry.finish(record)


def _policy_params(config: GatewayConfig) -> dict[str, float]:
    """The routing tunables the config exposes (round_robin takes none)."""
    if config.routing.policy == "round_robin":
        return {}
    return {"load_epsilon": config.routing.load_epsilon, "load_slack": config.routing.load_slack}


class _RawResponse(Response):
    """A complete upstream body with the upstream's own headers, sent as is."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes):
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # Starlette's, minus what it never needs
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


class _PreciseHubs:
    """The precise pools' event hubs as one, for the metrics collector (pools come and go with reloads)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def clock(self) -> float:
        return float(self._gateway.clock())

    def iter_sources(self) -> Any:
        for precise in list(self._gateway.precise.values()):
            yield from precise.hub.iter_sources()


def _usage_of(body: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def build_app(config: GatewayConfig, config_path: str | None = None, resolver: Any = None) -> Starlette:
    """The ASGI app; with `config_path` the file is watched and reloadable (SIGHUP, /admin/reload)."""
    from gateway.admin import admin_routes
    from gateway.reload import ConfigReloader
    from gateway.routes import generate_endpoints, routes

    gateway = Gateway(config, resolver=resolver)
    reloader = ConfigReloader(gateway, config_path)

    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        await gateway.start()
        if config_path and config.admin.watch_config:
            reloader.start_watching()
        if config_path:
            _on_sighup(lambda: asyncio.ensure_future(reloader.reload("SIGHUP")))
        try:
            yield
        finally:
            await reloader.stop()
            await gateway.stop()

    app = GatewayApp(generate_endpoints(gateway), routes=[*routes(), *admin_routes()], lifespan=lifespan,
                     exception_handlers=_exception_handlers())
    app.state.gateway = gateway
    app.state.reloader = reloader
    return app


class GatewayApp(Starlette):
    """Starlette, except that POSTs to the generate paths go straight to their endpoints (`fast_routes`), ahead of
    the middleware stack and router: the hot path pays for neither. Everything else is plain Starlette."""

    def __init__(self, fast_routes: Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = dict(fast_routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _on_sighup(callback: Any) -> None:
    import signal

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, callback)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass


def _exception_handlers() -> dict[Any, Any]:
    """Even the gateway's own surprises and unknown paths answer in OpenAI's error shape."""
    from starlette.exceptions import HTTPException

    from gateway.errors import error_response

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, message, type_, code=exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "The gateway failed on this request; it has been logged.", "server_error")

    return {HTTPException: http_error, Exception: internal_error}
