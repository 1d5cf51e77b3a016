"""Where a replica's KV events come from: its publishers' endpoints as the gateway reaches them.

From config (`tcp://*:5557` as given to vLLM; `*`, 0.0.0.0 and `::` become the replica's host; DP rank r publishes on
port + r) or discovered from the replica's `GET /kv_event_sources`. A replica with data-parallel ranks has one source
per rank, each feeding the index under its own key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "KvEventSource",
    "ReplicaEvents",
    "resolve_endpoint",
    "source_key",
    "sources_from_config",
    "sources_from_discovery",
]


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One publisher: the index key it feeds, the replica it belongs to, where to connect."""

    key: str
    replica: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def resolve_endpoint(endpoint: str, replica_url: str, rank: int = 0) -> str:
    """vLLM's endpoint as seen from the gateway: wildcard hosts become the replica's host; DP rank r is port + r
    (vLLM's offset_endpoint_port); a port of 0 was resolved by vLLM, so only discovery can say it."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    if endpoint.startswith("tcp://"):
        address = endpoint[len("tcp://"):]
        base, _, port = address.rpartition(":")
        if base in ("*", "0.0.0.0", "[::]", "::", "") or base.startswith("*"):
            base = host
        if rank and port.isdigit() and int(port):
            port = str(int(port) + rank)
        return f"tcp://{base}:{port}"
    if rank and endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    return endpoint


def source_key(replica: str, rank: int) -> str:
    """The index key of one DP rank's publisher (rank 0: the replica's URL itself)."""
    return replica if rank == 0 else f"{replica}#dp{rank}"


@dataclass(frozen=True, slots=True)
class ReplicaEvents:
    """What the hub should subscribe to for one replica (built from the pool's `precise` config)."""

    replica: str
    pool: str = ""
    kv_blocks: int | None = None
    endpoint: str | None = None  # as in vLLM's --kv-events-config; None: GET /kv_event_sources
    replay_endpoint: str | None = None
    topic: str = ""
    data_parallel_size: int = 1
    headers: tuple[tuple[str, str], ...] = ()


def sources_from_config(target: ReplicaEvents) -> list[KvEventSource]:
    assert target.endpoint is not None
    return [
        KvEventSource(
            key=source_key(target.replica, rank),
            replica=target.replica,
            endpoint=resolve_endpoint(target.endpoint, target.replica, rank),
            replay_endpoint=resolve_endpoint(target.replay_endpoint, target.replica, rank)
            if target.replay_endpoint else None,
            topic=target.topic,
        )
        for rank in range(max(1, target.data_parallel_size))
    ]


def sources_from_discovery(replica: str, body: Any) -> list[KvEventSource]:
    """Sources from a `/kv_event_sources` answer: {"0": {"endpoint": ..., "replay_endpoint": ..., "topic": ...}}."""
    if not isinstance(body, dict):
        return []
    out = []
    for rank_key, cfg in sorted(body.items(), key=lambda kv: str(kv[0])):
        if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events", True):
            continue
        if cfg.get("publisher", "zmq") != "zmq" or not isinstance(cfg.get("endpoint"), str):
            continue
        try:
            rank = int(rank_key)
        except (TypeError, ValueError):
            rank = 0
        replay = cfg.get("replay_endpoint")
        # /kv_event_sources reports each rank's own endpoints (already offset): only wildcards are replaced
        out.append(KvEventSource(
            key=source_key(replica, rank), replica=replica, endpoint=resolve_endpoint(cfg["endpoint"], replica),
            replay_endpoint=resolve_endpoint(replay, replica) if isinstance(replay, str) and replay else None,
            topic=str(cfg.get("topic") or ""),
        ))
    return out
