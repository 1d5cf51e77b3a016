"""`Gateway`: everything one gateway process knows and keeps running, apart from any one request.

Config, pools and their replicas, one replica policy per pool, the prefix indexes, the upstream HTTP session, the
health monitor, DNS discovery, shared state, traffic control and telemetry; started and stopped together, and
re-pointed as a whole when a reloaded config is applied. The request path itself is `gateway/coordinator.py`.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from gateway.admission import TrafficControl
from gateway.capacity.signal import CapacitySignal
from gateway.discovery import DiscoveryManager
from gateway.precise import PreciseRouting
from gateway.observability.recent import RecentRequests
from gateway.relay import DisconnectWatches
from gateway.sessions import SessionTracker
from gateway.observability.telemetry import Telemetry
from policies.admission import pool_pressure, pool_saturated
from policies.config import GatewayConfig
from policies.estimates import TokenEstimateRatios
from policies.latency_model import TtftCalibrator
from policies.output_estimate import OutputEstimator
from policies.replica_choice import ReplicaPolicy, RoutingRequest, build_policy
from policies.tokens import TokenCounter
from pools.monitor import ReplicaMonitor
from pools.prefix_index import PrefixIndex
from pools.replicas import PoolRuntime, Replica
from pools.sessions import Session
from pools.shared_state import SharedState, build_shared_state


class Gateway:
    """One gateway's state and lifecycle: built from a config, started, reloaded, stopped."""

    def __init__(self, config: GatewayConfig, clock: Any = time.monotonic, resolver: Any = None) -> None:
        self.config = config
        self.clock = clock
        self.counter = TokenCounter(config.classification)
        self.estimates = TokenEstimateRatios()  # what the replicas count ÷ the gateway's estimate, per pool
        self.latency: dict[str, TtftCalibrator] = {}  # per pool: the TTFT model calibrated on its answers
        self.output_estimates: OutputEstimator | None = None  # output lengths per session, key, class (_apply_config)
        self.pools: dict[str, PoolRuntime] = {}
        self.policies: dict[str, ReplicaPolicy] = {}
        self.prefix_index = PrefixIndex()
        self.precise = PreciseRouting(self.prefix_index, clock)  # pools routing from their replicas' KV events
        self.session: aiohttp.ClientSession | None = None
        self.monitor: ReplicaMonitor | None = None
        self.watches = DisconnectWatches()
        self._apply_config(config)
        self.telemetry = Telemetry(self)
        self.recent = RecentRequests()  # the status page's latest requests, kept only while it is open
        self.discovery = DiscoveryManager(lambda: self.pools, self.sync_prefix_index, resolver)
        shares = bool(config.state) and config.state != "memory"
        self.sessions = SessionTracker(config.sessions, shared=shares, on_end=self._session_ended) \
            if config.sessions.enabled else None
        self.shared: SharedState = build_shared_state(
            config.state, self._apply_remote_dispatch, self._local_in_flight, model=config.model,
            sessions=self.sessions.store if self.sessions is not None and shares else None,
        )
        self.traffic = TrafficControl(config, clock, self.pool_saturated, self.pool_pressure, self.pool_batches_full)
        self.capacity = CapacitySignal(self)  # replicas each pool role needs (m3gate_pool_desired_replicas)

    # config ------------------------------------------------------------------------------------------------
    def _apply_config(self, config: GatewayConfig) -> None:
        previous = self.pools
        policy_changed = config.routing != self.config.routing
        self.config = config
        self.pools = {p.name: PoolRuntime.from_config(p, previous.get(p.name)) for p in config.pools_by_size()}
        rebuilt = self.precise.configure(config, self.pools)
        self.policies = {
            name: (None if policy_changed or name in rebuilt else self.policies.get(name))
            or build_policy(config.routing.policy, prefix_index=self.precise.matcher(name),
                            calibrator=self.latency.setdefault(name, TtftCalibrator()), **policy_params(config))
            for name in self.pools
        }
        for name in [n for n in self.latency if n not in self.pools]:
            del self.latency[name]
        self.served_models = frozenset(config.served_model_ids())
        self.estimates.keep_only(set(self.pools))
        self._apply_output_estimate(config)
        self.sync_prefix_index()

    def _apply_output_estimate(self, config: GatewayConfig) -> None:
        """Estimates output lengths while `routing.output_estimate` is on; what was learnt survives a reload that
        keeps its buckets and bounds."""
        cfg = config.routing.output_estimate
        if not cfg.enabled:
            self.output_estimates = None
            return
        buckets = (cfg.short_tokens, cfg.medium_tokens, cfg.long_tokens)
        kept = self.output_estimates
        if kept is None or kept.bucket_tokens != buckets or kept.sessions.max_entries != cfg.max_sessions \
                or kept.sessions.ttl_s != cfg.ttl_s:
            self.output_estimates = OutputEstimator(buckets, ttl_s=cfg.ttl_s, max_sessions=cfg.max_sessions)

    def sync_prefix_index(self) -> None:
        """Bound each replica's prefix index by its KV capacity; forget replicas that left the config."""
        self.prefix_index.sync({r.url: r.kv_blocks for r in self.all_replicas()})
        self.precise.sync(self.pools)
        if self.monitor is not None:
            self.monitor.replicas_changed()  # a reload or discovery may have added or removed replicas

    def apply_config(self, config: GatewayConfig) -> list[str]:
        """Swap in a validated config. Kept endpoints keep their state; requests in flight on removed ones finish.
        Returns notes about settings that only take effect on restart."""
        old = self.config
        notes = []
        if config.server.host != old.server.host or config.server.port != old.server.port:
            notes.append("server.host/port changes take effect on restart")
        if (config.server.workers, config.server.worker_port_base) != (old.server.workers, old.server.worker_port_base):
            notes.append("server.workers/worker_port_base changes take effect on restart")
        if config.state != old.state:
            notes.append("`state` changes take effect on restart")
        if (config.batch.enabled, config.batch.store, config.batch.files_dir) != \
                (old.batch.enabled, old.batch.store, old.batch.files_dir):
            notes.append("batch.enabled/store/files_dir changes take effect on restart")
        if config.classification.encoding != old.classification.encoding:
            self.counter = TokenCounter(config.classification)
        if config.sessions.enabled != old.sessions.enabled:
            notes.append("sessions.enabled changes take effect on restart")
        elif self.sessions is not None:
            self.sessions.apply_config(config.sessions)
        self._apply_config(config)
        notes.extend(self.traffic.apply_config(config))
        self.telemetry.apply_config(config)
        return notes

    def telemetry_reload(self, ok: bool) -> None:
        self.telemetry.config_reloaded(ok)

    # lifecycle ---------------------------------------------------------------------------------------------
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
            self.session, self.all_replicas, server.health_interval_s, headers_for=self.probe_headers,
            clock=self.clock, on_capacity=self.sync_prefix_index,
        )
        self.watches.start()
        await self.discovery.sync()
        await self.monitor.poll_once()
        self.monitor.start()
        await self.shared.start()
        await self.traffic.start()
        await self.precise.start(self.session, self.pools)
        self.capacity.start()

    async def stop(self) -> None:
        await self.capacity.stop()
        await self.watches.stop()
        await self.precise.stop()
        await self.discovery.stop()
        await self.traffic.stop()
        await self.shared.stop()
        if self.monitor:
            await self.monitor.stop()
        if self.session:
            await self.session.close()
        await self.telemetry.shutdown()

    # views the collaborators read --------------------------------------------------------------------------
    def all_replicas(self) -> list[Replica]:
        return [r for pool in self.pools.values() for r in pool.replicas.values()]

    def pool_saturated(self, name: str) -> bool:
        """Every available replica of the pool reports a long vLLM queue or a full KV cache (admission waits).
        Snapshots are built one at a time, as the check reads them: it stops at the first replica with room, so an
        unsaturated pool costs one snapshot however many replicas it has (saturation reads no shared state)."""
        pool = self.pools.get(name)
        if pool is None:
            return False
        now = self.clock()
        replicas = pool.of_role("serving") if pool.disaggregated else pool.replicas.values()
        return pool_saturated((r.snapshot(now) for r in replicas), self.config.traffic.saturation)

    def pool_pressure(self, name: str) -> bool:
        """Some available replica of the pool is saturated (the background lane backs off)."""
        pool = self.pools.get(name)
        if pool is None:
            return False
        return pool_pressure(pool.snapshots(self.clock(), self.shared), self.config.traffic.saturation)

    def pool_batches_full(self, name: str) -> bool:
        """Every available replica of the pool runs as many requests of this gateway as vLLM was seen running when
        it left others waiting (`Replica.batch_full_at`): a background request sent now would wait in vLLM's queue,
        ahead of the foreground requests that come after it. A replica never seen full leaves room (the lane finds
        the limit by filling it)."""
        pool = self.pools.get(name)
        if pool is None:
            return False
        now = self.clock()
        for replica in (pool.of_role("serving") if pool.disaggregated else pool.replicas.values()):
            if replica.is_available(now) and replica.has_batch_slot():
                return False
        return True

    def probe_headers(self, replica: Replica) -> dict[str, str]:
        pool = self.pools.get(replica.pool)
        return pool.probe_headers() if pool is not None else {}

    def _apply_remote_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        """Another gateway sent `request` to `replica`: learn it as if this gateway had (prefix index, sessions)."""
        policy = self.policies.get(pool)
        if policy is not None and replica in self.pools[pool].replicas:
            policy.dispatched(request, replica, self.clock())

    def _session_ended(self, session: Session) -> None:
        metrics = self.telemetry.metrics
        if metrics is not None:
            metrics.requests.session_ended(session)

    def _local_in_flight(self) -> dict[str, int]:
        return {r.url: r.in_flight for r in self.all_replicas()}


def policy_params(config: GatewayConfig) -> dict[str, float]:
    """The routing tunables the config exposes (round_robin takes none): for every policy built from the config,
    the pools' own and a disaggregated pool's prefill policy (gateway/disagg.py)."""
    if config.routing.policy == "round_robin":
        return {}
    routing = config.routing
    return {"load_epsilon": routing.load_epsilon, "load_slack": routing.load_slack,
            "placement_window_s": routing.placement.window_s, "move_cost_factor": routing.placement.move_cost_factor}
