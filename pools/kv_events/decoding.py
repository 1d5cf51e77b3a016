"""Decoding vLLM's KV-event batches: the msgpack payload of one published step, in either layout vLLM has used.

Events come as maps tagged `"type"` (0.32) or as arrays whose first item is the tag (≈0.11 and before); the batch as
an array `[ts, events, dp_rank?]` or a map. Block hashes may be ints (the default,
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or raw digests; both become the low 64 bits. Only the GPU tier (medium None or
"GPU") and KV-cache group 0 feed the index (`counts_for_routing`): a CPU-offload copy or a sliding-window group's
blocks do not make a prefix hit by themselves. The events carry prompt token ids, which are decoded and dropped at
once, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "KvEventDecodeError",
    "counts_for_routing",
    "decode_batch",
]

_LOW64 = (1 << 64) - 1


class KvEventDecodeError(ValueError):
    """A payload that is not a KVEventBatch in any known layout."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    block_size: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    token_ids: tuple[int, ...] = ()  # the stored blocks' tokens, concatenated (what the hash check reads)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    skipped: int = 0  # events of unknown types (newer vLLM): ignored, counted


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _LOW64
    if isinstance(value, (bytes, bytearray)) and value:
        return int.from_bytes(bytes(value[-8:]), "big")
    raise KvEventDecodeError(f"a block hash must be an int or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise KvEventDecodeError("block_hashes must be an array")
    return tuple(_hash(v) for v in value)


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# The array layout's field order per tag (msgspec array_like: the tag first, then fields in declaration order).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _ARRAY_FIELDS.get(tag)
        if names is None:
            return None
        fields = dict(zip(names, raw[1:]))
    else:
        raise KvEventDecodeError(f"an event must be a map or a tagged array, not {type(raw).__name__}")
    if tag == "BlockStored":
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids")
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            block_size=_opt_int(fields.get("block_size")),
            medium=_opt_str(fields.get("medium")),
            group_idx=_opt_int(fields.get("group_idx")),
            token_ids=tuple(tokens) if parent is None and isinstance(tokens, list) else (),  # only roots are checked
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes")),
            medium=_opt_str(fields.get("medium")),
            group_idx=_opt_int(fields.get("group_idx")),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(medium=_opt_str(fields.get("medium")))
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """A KVEventBatch from its msgpack payload, in either layout; raises KvEventDecodeError."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on bad input
        raise KvEventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError("a batch must be [ts, events, rank?] or a map")
    if not isinstance(events, (list, tuple)):
        raise KvEventDecodeError("the batch's events must be an array")
    decoded: list[Event] = []
    skipped = 0
    for item in events:
        event = _event(item)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts) if isinstance(ts, (int, float)) else 0.0, tuple(decoded), _opt_int(rank), skipped)


def counts_for_routing(medium: str | None, group_idx: int | None) -> bool:
    """Whether an event's blocks feed routing: the GPU tier's, of KV-cache group 0."""
    return (medium is None or medium == "GPU") and not group_idx

