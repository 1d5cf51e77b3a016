"""What the gateway knows about each replica at run time: health, its own in-flight load, scraped vLLM load and
latency estimates. Policies never see these objects, only the immutable `ReplicaSnapshot`s they produce.

Load accounting goes through `Replica.guard()` (a context manager), so no code path — error, retry, client
disconnect — can leak an in-flight count (peers' PS PR #1072 / VR #179 class of bugs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from policies.snapshot import ReplicaSnapshot
from policies.config import DnsDiscovery, PoolConfig
from pools.shared_state import SharedState

EWMA_ALPHA = 0.2
EJECT_BASE_S = 1.0
EJECT_MAX_S = 30.0
EJECT_AFTER_5XX = 3  # consecutive 5xx answers before a replica that still answers is ejected

log = logging.getLogger("m3gate.replicas")


@dataclass
class ScrapedLoad:
    """The subset of a replica's /metrics that routing reads."""

    waiting: float
    running: float
    kv_usage: float
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None


class LoadGuard:
    """Releases a replica's in-flight count exactly once: usable as `with` or by an explicit `release()`, so a
    streaming response can hold it past the handler's return and drop it when the stream ends or is cancelled."""

    __slots__ = ("_replica", "_tokens", "_prefill")

    def __init__(self, replica: Replica, tokens: int, prefill: int = 0):
        self._replica: Replica | None = replica
        self._tokens = tokens
        self._prefill = prefill

    def first_token(self) -> None:
        """The replica has prefilled this request: its uncached tokens no longer wait ahead of others."""
        replica, prefill = self._replica, self._prefill
        if replica is not None and prefill:
            self._prefill = 0
            replica.prefill_tokens -= prefill
            replica.prefilled_tokens += prefill

    def release(self) -> None:
        replica, self._replica = self._replica, None
        if replica is not None:
            replica.in_flight -= 1
            replica.in_flight_tokens -= self._tokens
            replica.prefill_tokens -= self._prefill

    def __enter__(self) -> LoadGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # last line of defence; release() is always called explicitly
        self.release()


@dataclass
class Replica:
    url: str
    pool: str
    block_size: int = 128
    kv_blocks: int | None = None
    # health
    healthy: bool = True  # last active /health answer
    draining: bool = False  # drained by the admin API
    # The replica itself is shutting down (SIGTERM): it refused a request as vLLM does then, refused the connection,
    # or /health answered 503. No new requests until the monitor sees it take them again; its streams finish.
    shutting_down: str | None = None  # why, while it is
    drains: int = 0  # times it was seen shutting down
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    ejections: int = 0
    # own load
    in_flight: int = 0
    in_flight_tokens: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens sent to it that have not reached their first token yet
    prefilled_tokens: int = 0  # uncached prompt tokens of its requests that reached their first token, ever
    step_start: float = 0.0  # its virtual prefill step clock (monotonic): the last planned step's start and end,
    step_end: float = 0.0
    step_tokens: int = 0  # and its uncached tokens
    # scraped load
    scraped: ScrapedLoad | None = None
    scraped_at: float | None = None
    batch_full_at: float = 0.0  # the most requests it was scraped running while vLLM left others waiting (its
    # batch, KV or token budget full): it runs no more at once. 0: never seen full
    # latency estimates (EWMA)
    prefill_s_per_token: float = 60e-6
    tpot_s: float = 0.02
    requests_total: int = field(default=0)
    role: str = "both"  # "prefill" | "decode" in a disaggregated pool (`PoolRuntime.snapshots` serves the others)
    # probing (pools/monitor.py): told of a dispatch while the replica's probes are backed off, and of every failure
    # or drain, so its next probe comes sooner; `probe_wake(replica, failed)`
    probe_wake: Callable[[Replica, bool], None] | None = field(default=None, repr=False, compare=False)
    probe_backed_off: bool = field(default=False, repr=False, compare=False)

    def has_batch_slot(self) -> bool:
        """This gateway's requests on it are fewer than vLLM runs at once (`batch_full_at`), or that is not known."""
        return self.batch_full_at <= 0 or self.in_flight < self.batch_full_at

    def is_available(self, now: float) -> bool:
        return self.healthy and not self.draining and self.shutting_down is None and now >= self.ejected_until

    @property
    def drain_state(self) -> str | None:
        """Why it takes no new requests while its streams finish: "admin", the replica's own shutdown, or None."""
        return "admin" if self.draining else self.shutting_down

    def snapshot(self, now: float, remote_in_flight: int = 0) -> ReplicaSnapshot:
        """What policies see. `remote_in_flight` is other gateways' load on it (shared state)."""
        s = self.scraped
        scraped_at = self.scraped_at
        # By position, in ReplicaSnapshot's field order (keywords cost ~0.4 µs more per snapshot, several per request)
        return ReplicaSnapshot(
            self.url,  # url
            self.pool,  # pool
            self.healthy and now >= self.ejected_until,  # healthy
            self.draining or self.shutting_down is not None,  # draining
            self.in_flight + remote_in_flight,  # in_flight
            self.in_flight_tokens,  # in_flight_tokens
            None if s is None else s.waiting,  # waiting
            None if s is None else s.running,  # running
            None if s is None else s.kv_usage,  # kv_usage
            None if scraped_at is None else now - scraped_at,  # metrics_age_s
            self.prefill_s_per_token,  # prefill_s_per_token
            self.tpot_s,  # tpot_s
            self.kv_blocks,  # kv_blocks
            self.block_size,  # block_size
            self.prefill_tokens,  # prefill_tokens
            self.step_start - now,  # step_starts_in
            self.step_end - now,  # step_ends_in
            self.step_tokens,  # step_tokens
        )

    def plan_step(self, now: float, plan: tuple[float, int, float]) -> None:
        """A request was sent with the routing decision's `prefill_plan`: its step is now the replica's last planned
        one (policies/latency_model.prefill_plan)."""
        offset, tokens, ttft = plan
        self.step_start, self.step_end, self.step_tokens = now + offset, now + ttft, tokens

    def guard(self, tokens: int, prefill_tokens: int = 0) -> LoadGuard:
        """Count one request and its tokens as in flight until the guard is released (idempotently), and its
        `prefill_tokens` (uncached prompt) as waiting for prefill until `first_token()` or the release."""
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self.prefill_tokens += prefill_tokens
        self.requests_total += 1
        if self.probe_backed_off:  # idle until now: its load is to be scraped at the base interval again
            self._probe_event(failed=False)
        return LoadGuard(self, tokens, prefill_tokens)

    def _probe_event(self, failed: bool) -> None:
        self.probe_backed_off = False
        wake = self.probe_wake
        if wake is not None:
            wake(self, failed)

    # passive health -------------------------------------------------------------------------------------------
    def record_failure(self, now: float, answered: bool = False) -> None:
        """A connection error, timeout or broken stream: eject with exponential back-off so a dead replica stops
        costing retries. A 5xx the replica `answered` ejects only once EJECT_AFTER_5XX come in a row: the replica is
        up, and one request that makes it fail (a client's malformed input) must not take it out of rotation."""
        self.consecutive_failures += 1
        self._probe_event(failed=True)  # /health says soon whether it is down
        if answered and self.consecutive_failures < EJECT_AFTER_5XX:
            return
        backoff = min(EJECT_MAX_S, EJECT_BASE_S * 2 ** (self.consecutive_failures - 1))
        self.ejected_until = now + backoff
        self.ejections += 1

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.ejected_until = 0.0

    def start_draining(self, why: str) -> None:
        """The replica is shutting down (`why`): no new requests. Not a failure: it ejects nothing, and the request
        it refused goes to another replica before its first byte."""
        if self.shutting_down is None:
            self.shutting_down = why
            self.drains += 1
            self._probe_event(failed=True)  # probed at the base interval: its return shows soon
            log.warning("replica %s (pool %s) is shutting down (%s): draining", self.url, self.pool, why)

    def stop_draining(self) -> None:
        """The replica takes requests again (a restarted process at the same URL): back in rotation at once, without
        the back-off of failures seen while it was down."""
        if self.shutting_down is not None:
            log.warning("replica %s (pool %s) takes requests again after draining", self.url, self.pool)
            self.shutting_down = None
            self.record_success()

    def observe_latency(self, uncached_prompt_tokens: int, ttft_s: float, output_tokens: int, decode_s: float) -> None:
        if uncached_prompt_tokens > 0 and ttft_s > 0:
            sample = ttft_s / uncached_prompt_tokens
            self.prefill_s_per_token += EWMA_ALPHA * (sample - self.prefill_s_per_token)
        if output_tokens > 1 and decode_s > 0:
            sample = decode_s / (output_tokens - 1)
            if math.isfinite(sample):
                self.tpot_s += EWMA_ALPHA * (sample - self.tpot_s)


@dataclass
class PoolRuntime:
    """A configured pool and its live replicas (kept across config reloads when the URL stays).

    A disaggregated pool holds both roles in `replicas`, each Replica with its `role`; `snapshots()` and
    `available()` see the replicas that answer a client (decode, or aggregated "both"), `snapshots(role="prefill")`
    the prefill side. Health checks, scrapes, drain and metrics go over all of them."""

    config: PoolConfig
    replicas: dict[str, Replica]
    discovered: set[str] = field(default_factory=set)  # "role\x00url" in a disaggregated pool, else url
    disaggregated: bool = False

    @classmethod
    def from_config(cls, config: PoolConfig, previous: PoolRuntime | None = None) -> PoolRuntime:
        """Replicas listed in the config plus, while the pool keeps the same DNS discovery, the ones found by it."""
        kept = previous.replicas if previous else {}
        same = previous is not None and previous.discovery_specs() == _discovery_specs(config)
        discovered = set(previous.discovered) if previous and same and _discovery_specs(config) else set()
        pool = cls(config=config, replicas={}, discovered=discovered, disaggregated=config.disaggregation is not None)
        for role, endpoints in pool.listed().items():
            for url in endpoints:
                pool._add(url, kept.get(url), role)
        for entry in sorted(discovered):
            role, url = _split(entry)
            pool._add(url, kept.get(url), role)
        return pool

    def listed(self) -> dict[str, list[str]]:
        """The configured endpoints by role."""
        d = self.config.disaggregation
        if d is None:
            return {"both": list(self.config.endpoints)}
        return {"prefill": list(d.prefill.endpoints), "decode": list(d.decode.endpoints)}

    def discovery_specs(self) -> dict[str, DnsDiscovery]:
        """The DNS discovery of each role that has one ("both" for an aggregated pool)."""
        return _discovery_specs(self.config)

    def _add(self, url: str, existing: Replica | None = None, role: str = "both") -> None:
        replica = existing or Replica(url=url, pool=self.config.name)
        replica.block_size = self.config.block_size
        replica.kv_blocks = self.config.kv_blocks or replica.kv_blocks
        replica.batch_full_at = float(self.config.max_num_seqs or replica.batch_full_at)
        replica.role = role
        self.replicas[url] = replica

    def apply_discovery(self, added: set[str], removed: set[str], role: str = "both") -> None:
        """DNS discovery changed the replica set. Removed replicas drain: requests on them hold their own reference."""
        key = (lambda url: url) if role == "both" else (lambda url: f"{role}\x00{url}")
        self.discovered = (self.discovered | {key(u) for u in added}) - {key(u) for u in removed}
        listed = {u for urls in self.listed().values() for u in urls}
        for url in added:
            if url not in self.replicas:
                self._add(url, None, role)
        for url in removed:
            if url not in listed:
                self.replicas.pop(url, None)

    @property
    def name(self) -> str:
        return self.config.name

    def probe_headers(self) -> dict[str, str]:
        """The pool's own key, for the gateway's calls to its replicas (health, /metrics, /tokenize, KV events)."""
        key = self.config.api_key
        return {"authorization": f"Bearer {key.get_secret_value()}"} if key else {}

    def snapshots(
        self, now: float, shared: SharedState | None = None, role: str | None = "serving"
    ) -> list[ReplicaSnapshot]:
        """The replicas of `role`: "serving" (those a client request goes to: all but prefill ones), "prefill",
        or None (every replica, in `replicas` order)."""
        replicas = self.of_role(role) if self.disaggregated else self.replicas.values()
        if shared is None:
            return [r.snapshot(now) for r in replicas]
        remote = shared.remote_in_flight
        return [r.snapshot(now, remote(r.url)) for r in replicas]

    def snapshots_of(self, urls: Iterable[str], now: float,
                     shared: SharedState | None = None) -> list[ReplicaSnapshot]:
        """`snapshots` of just the replicas at `urls` that serve clients (a policy's shortlist; unknown ones skipped)."""
        replicas = self.replicas
        remote = shared.remote_in_flight if shared is not None else None
        out = []
        for url in urls:
            r = replicas.get(url)
            if r is not None and r.role != "prefill":
                out.append(r.snapshot(now, remote(url)) if remote is not None else r.snapshot(now))
        return out

    def of_role(self, role: str | None) -> list[Replica]:
        if role is None:
            return list(self.replicas.values())
        if role == "serving":
            return [r for r in self.replicas.values() if r.role != "prefill"]
        return [r for r in self.replicas.values() if r.role == role]

    def available(self, now: float) -> bool:
        """Some replica that serves clients is available (`Replica.is_available`, inlined: this runs per pool on
        every request)."""
        for r in self.replicas.values():
            if (r.healthy and not r.draining and r.shutting_down is None and now >= r.ejected_until
                    and r.role != "prefill"):
                return True
        return False


def _discovery_specs(config: PoolConfig) -> dict[str, DnsDiscovery]:
    d = config.disaggregation
    if d is None:
        return {"both": config.discovery} if config.discovery else {}
    return {role: spec for role, spec in (("prefill", d.prefill.discovery), ("decode", d.decode.discovery)) if spec}


def _split(entry: str) -> tuple[str, str]:
    role, sep, url = entry.partition("\x00")
    return (role, url) if sep else ("both", entry)
