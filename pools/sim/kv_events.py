"""KV-cache events from the simulator, on the wire exactly as vLLM 0.32 publishes them.

`m3gate sim --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
"replay_endpoint":"tcp://*:5558","topic":"kv"}' --prefix-caching-hash-algo sha256_cbor` makes a simulated replica
publish its prefix cache's changes (pools/sim/prefix_cache.py's `CacheEventSink`) so that precise routing can be load
tested without GPUs:

- PUB socket: multipart `[topic, seq (8 bytes big-endian), msgpack KVEventBatch]`, one batch per engine step that
  changed the cache (events raised in one synchronous step are gathered by a `call_soon` flush), seq from 0;
- the batch `[ts, [events...], 0]`, events as maps tagged `"type"` (BlockStored with block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name; BlockRemoved one hash each; AllBlocksCleared);
- ROUTER replay socket keeping the last `buffer_steps` batches: `[b"", start_seq]` → `[b"", topic, seq, payload]`
  per batch from start_seq, then `[b"", b"", -1, b""]`;
- endpoints containing `*` bind on all interfaces (as vLLM); `tcp://*:0` binds a free port on the sim's host, and
  `GET /kv_event_sources` reports what was bound (as vLLM reports a resolved `*:0`).

With `--prefix-caching-hash-algo sha256_cbor` (or sha256) the simulator's block hashes are vLLM's own over its token
ids (policies/vllm_hash.py), so a gateway that tokenizes like the simulator (same tokenizer folder) reproduces them.
BlockStored's token_ids are the stored blocks' tokens, concatenated, as vLLM sends them, for blocks whose tokens the
publisher still remembers (a bounded memory of recently prepared prompts; empty otherwise). The process's
PYTHONHASHSEED seeds NONE_HASH exactly as in vLLM, so a simulator started with another seed than the gateway's
`precise.hash_seed` publishes hashes the gateway cannot reproduce, as a misconfigured vLLM would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from policies.vllm_hash import block_hashes as vllm_block_hashes
from pools.sim.tokenizer import Tokens

__all__ = ["SimEventPublisher", "parse_kv_events_config", "vllm_hashes"]

_REMEMBERED_BLOCKS = 16_384  # ~8 MiB of token ids at 128 per block

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False, "publisher": None, "endpoint": "tcp://*:5557", "replay_endpoint": None,
    "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000, "topic": "",
}  # fmt: skip


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """vLLM's KVEventsConfig from its JSON (unknown keys refused, publisher defaulting as vLLM does)."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = set(raw) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
    cfg = {**DEFAULTS, **raw}
    if cfg["publisher"] is None:
        cfg["publisher"] = "zmq" if cfg["enable_kv_cache_events"] else "null"
    if cfg["publisher"] not in ("zmq", "null"):
        raise ValueError(f"Unknown event publisher '{cfg['publisher']}'")
    return cfg


def vllm_hashes(tokens: Tokens, block_size: int, cache_salt: str | None, algo: str,
                seed: str | None = None) -> list[int]:
    """vLLM's published block hashes (low 64 bits) of a prompt's full blocks."""
    if tokens.count < block_size:
        return []
    return list(vllm_block_hashes(tokens.ids(), block_size, algo=algo, cache_salt=cache_salt, seed=seed))


class SimEventPublisher:
    """A `CacheEventSink` that publishes over ZMQ like vLLM's ZmqEventPublisher (see the module docstring)."""

    def __init__(self, config: dict[str, Any], block_size: int, host: str = "127.0.0.1") -> None:
        self.config = config
        self.block_size = block_size
        self._host = host
        self._topic = str(config.get("topic") or "").encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=int(config.get("buffer_steps") or 10_000))
        self._block_tokens: OrderedDict[int, array[int]] = OrderedDict()
        self._events: list[dict[str, Any]] = []
        self._seq = 0
        self._flush_scheduled = False
        self._ctx: zmq.asyncio.Context | None = None  # the replay ROUTER (served on the event loop)
        self._pub_ctx: zmq.Context[Any] | None = None  # the PUB socket: plain, sends never block
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.published = 0

    # -- sockets ------------------------------------------------------------------------------------------------

    def _bind(self, sock: Any, endpoint: str) -> str:
        """Bind as vLLM: wildcard endpoints bind all interfaces; `tcp://*:0` a free port on the sim's host."""
        if endpoint == "tcp://*:0":
            sock.bind(f"tcp://{self._host}:0")
            return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        sock.bind(endpoint)
        return endpoint

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub_ctx = zmq.Context()
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(int(self.config.get("hwm") or 100_000))
        endpoint = str(self.config["endpoint"])
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.endpoint = self._bind(self._pub, endpoint)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        replay = self.config.get("replay_endpoint")
        if replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, str(replay))
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        for ctx in (self._ctx, self._pub_ctx):
            if ctx is not None:
                ctx.term()
        self._ctx = self._pub_ctx = None

    def sources(self) -> dict[str, Any]:
        """GET /kv_event_sources: rank 0's resolved configuration."""
        return {"0": {**self.config, "endpoint": self.endpoint or self.config["endpoint"],
                      "replay_endpoint": self.replay_endpoint or self.config.get("replay_endpoint")}}

    # -- CacheEventSink -----------------------------------------------------------------------------------------

    def remember_tokens(self, hashes: Sequence[int], tokens: Tokens) -> None:
        """The token ids behind each full block of a prepared prompt, for its BlockStored events (bounded: the most
        recent `_REMEMBERED_BLOCKS` blocks, as compact arrays)."""
        ids = tokens.ids()
        size = self.block_size
        remembered = self._block_tokens
        for i, h in enumerate(hashes):
            if h in remembered:
                remembered.move_to_end(h)
                continue
            remembered[h] = array("I", ids[i * size:(i + 1) * size])
            if len(remembered) > _REMEMBERED_BLOCKS:
                remembered.popitem(last=False)

    def blocks_stored(self, parent_hash: int | None, hashes: Sequence[int], block_ids: Sequence[int]) -> None:
        known = [self._block_tokens.get(h) for h in hashes]
        token_ids = [t for block in known for t in block] if all(b is not None for b in known) else []  # type: ignore[union-attr]
        self._add({"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent_hash,
                   "token_ids": token_ids, "block_size": self.block_size, "lora_id": None, "medium": "GPU",
                   "lora_name": None})

    def block_removed(self, block_hash: int) -> None:
        self._add({"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU"})

    def all_cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def _add(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a test driving the engine by hand): publish at once
                self.flush()

    def flush(self) -> None:
        """Publish the events gathered so far as one batch (one engine step's worth)."""
        self._flush_scheduled = False
        if not self._events:
            return
        payload = msgpack.packb([time.time(), self._events, 0], use_bin_type=True)
        self._events = []
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.published += 1

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
