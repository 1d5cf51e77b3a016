"""`PrecisePool`: one pool's precise prefix routing as the gateway holds it.

Its exact index (pools/exact_index.py), the KV-event subscriptions that feed it (pools/kv_events/), the hybrid
matcher its PrefixAffinity policy reads, and the prompt hasher that computes requests' exact block hashes. Built from
the pool's config (`precise`, its block_size and launch spec); rebuilt whole when any of that changes
(`identity_for`). The approximate index is the gateway's, shared with approximate pools.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from policies.config import PoolConfig, PreciseConfig
from policies.vllm_hash import block_hashes
from pools.exact_index import ExactIndex, HybridMatcher
from pools.kv_events.hub import KvEventHub
from pools.kv_events.sources import ReplicaEvents
from pools.kv_events.subscriber import Clock, SubscriberSettings
from pools.prefix_index import PrefixIndex
from pools.replicas import Replica
from pools.tokenizer import HashSettings, LocalTokenizer, PromptHasher, ReplicaTokenizer, TokenizeSource

__all__ = ["PrecisePool", "first_block_hasher"]


def first_block_hasher(settings: HashSettings) -> Callable[[Sequence[int]], int | None]:
    """The gateway's hash of the first block of `token_ids` under the pool's hash settings (None if shorter)."""

    def first(token_ids: Sequence[int]) -> int | None:
        size = settings.block_size
        if len(token_ids) < size:
            return None
        try:
            found = block_hashes(token_ids[:size], size, algo=settings.algo, seed=settings.seed, max_blocks=1)
        except ValueError:  # an algorithm the gateway cannot reproduce without a seed
            return None
        return found[0] if found else None

    return first


class PrecisePool:
    """Everything precise routing needs for one pool (see the module docstring)."""

    def __init__(self, pool: PoolConfig, model: str, approx: PrefixIndex, clock: Clock = time.monotonic) -> None:
        cfg = pool.precise
        assert cfg is not None and cfg.enabled
        self.name = pool.name
        self.config: PreciseConfig = cfg
        self.model = model
        self.endpoint, self.replay_endpoint, self.ranks = self.endpoints_for(pool)
        self.identity = self.identity_for(pool, model)
        self.index = ExactIndex(clock, silent_after_s=cfg.silent_after_s, pending_ttl_s=cfg.pending_ttl_s)
        self.hash_settings = HashSettings(block_size=pool.block_size, algo=cfg.hash_algo, seed=cfg.hash_seed)
        self.hub = KvEventHub(self.index, clock, SubscriberSettings(
            replay_timeout_s=cfg.replay_timeout_s, stale_after_failure_s=cfg.stale_after_failure_s,
            first_block_hash=first_block_hasher(self.hash_settings)))
        self.matcher = HybridMatcher(approx, self.index, clock)
        self.hasher: PromptHasher | None = None  # a replica tokenizer needs the HTTP session: made by start()
        if cfg.tokenizer == "local":
            assert cfg.model_dir is not None  # PreciseConfig requires it with tokenizer: local
            self.hasher = PromptHasher(LocalTokenizer(cfg.model_dir, cfg.max_tokenize_chars), self.hash_settings)

    @staticmethod
    def endpoints_for(pool: PoolConfig) -> tuple[str | None, str | None, int]:
        """(endpoint, replay endpoint, DP ranks): the config's, else what `launch` renders, else discovery (None)."""
        cfg, launch = pool.precise, pool.launch
        assert cfg is not None
        endpoint, replay, ranks = cfg.endpoint, cfg.replay_endpoint, cfg.data_parallel_size
        if endpoint is None and launch is not None and launch.kv_events:
            endpoint = f"tcp://*:{launch.kv_events_port}"
            replay = replay or f"tcp://*:{launch.kv_events_replay_port}"
        if ranks is None:
            ranks = launch.data_parallel_size if launch is not None else 1
        return endpoint, replay, ranks

    @staticmethod
    def identity_for(pool: PoolConfig, model: str) -> tuple[object, ...]:
        """What, when changed by a reload, makes the pool's precise state start over."""
        return (pool.precise, pool.block_size, *PrecisePool.endpoints_for(pool), model)

    def targets(self, replicas: Sequence[Replica], headers: Mapping[str, str]) -> dict[str, ReplicaEvents]:
        """What to subscribe to for these replicas."""
        return {
            r.url: ReplicaEvents(
                replica=r.url, pool=self.name, kv_blocks=r.kv_blocks, endpoint=self.endpoint,
                replay_endpoint=self.replay_endpoint, topic=self.config.topic, data_parallel_size=self.ranks,
                headers=tuple(sorted(headers.items())),
            )
            for r in replicas
        }

    async def start(self, session: aiohttp.ClientSession, headers: Mapping[str, str] | None = None) -> None:
        if self.hasher is None:
            source: TokenizeSource = ReplicaTokenizer(session, self.model, headers, self.config.tokenize_timeout_s)
            self.hasher = PromptHasher(source, self.hash_settings)
        await self.hub.start(session)

    async def stop(self) -> None:
        await self.hub.stop()
        if self.hasher is not None:
            self.hasher.close()

    async def exact_hashes(self, payload: bytes, api: str, replica_url: str | None) -> tuple[int, ...]:
        if self.hasher is None:
            return ()
        return await self.hasher.hashes(payload, api, replica_url)
