"""vLLM's prefix-cache block hashes, computed in the gateway from token ids, bit for bit.

vLLM (v1, `v1/core/kv_cache_utils.py`) identifies each full KV block of a prompt by a hash chained on its parent:

    NONE_HASH = H(seed)                       # seed: $PYTHONHASHSEED if set, else "vllm-none-hash"
    h_0 = H((NONE_HASH, tuple(tokens[0:B]), extra_keys_0))
    h_k = H((h_{k-1}, tuple(tokens[k*B:(k+1)*B]), extra_keys_k))

where `H` is `--prefix-caching-hash-algo`, B is the block size, and `extra_keys_k` is None or a tuple of tagged keys
(`("cache_salt", salt)` on the first block only; LoRA, multimodal and prompt-embeds keys are not reproduced here:
requests carrying them are routed approximately). The KV events publish each hash as its low 64 bits (the digest's
last 8 bytes, big-endian) because `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` is the default.

Only the cryptographic algorithms are reproducible across processes without a shared seed:

- `sha256_cbor`: SHA-256 of canonical CBOR (`cbor2.dumps(x, canonical=True)`), the cross-language choice and the one
  m3gate's launch recipe renders;
- `sha256`: SHA-256 of pickle protocol 5. Reproducible here only because the gateway is Python too; kept for replicas
  left on vLLM's default.

`xxhash`/`xxhash_cbor` use a random per-process seed unless PYTHONHASHSEED is set, so they are accepted only with an
explicit `seed`.

Pure and synchronous: ~5 µs a block, so a 1M-token prompt (7,813 blocks of 128) costs tens of milliseconds; callers
on an event loop hash long prompts in a worker thread (pools.tokenizer does).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal

import cbor2

__all__ = [
    "DEFAULT_SEED",
    "HashAlgo",
    "HASH_ALGOS",
    "block_hashes",
    "block_digests",
    "external_hash",
    "hash_function",
    "none_hash",
    "salt_extra_keys",
]

HashAlgo = Literal["sha256_cbor", "sha256", "xxhash_cbor", "xxhash"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256_cbor", "sha256", "xxhash_cbor", "xxhash")
DEFAULT_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for the SHA algorithms when PYTHONHASHSEED is unset."""

_LOW64 = (1 << 64) - 1


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxhash_cbor(value: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(cbor2.dumps(value, canonical=True))


def _xxhash_pickle(value: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_pickle,
    "xxhash_cbor": _xxhash_cbor,
    "xxhash": _xxhash_pickle,
}


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name`."""
    try:
        return _FUNCTIONS[algo]
    except KeyError:
        raise ValueError(f"unsupported prefix-caching hash algorithm {algo!r}; known: {list(_FUNCTIONS)}") from None


@lru_cache(maxsize=16)
def none_hash(algo: str = "sha256_cbor", seed: str | None = None) -> bytes:
    """NONE_HASH, the first block's parent: H(seed). `seed` is the replicas' PYTHONHASHSEED, None when unset.

    The xxhash algorithms draw a random seed per vLLM process when PYTHONHASHSEED is unset: nothing outside that
    process can reproduce them, so a seed is required for them."""
    if seed is None:
        if algo.startswith("xxhash"):
            raise ValueError(f"{algo} block hashes are seeded randomly per vLLM process unless PYTHONHASHSEED is set")
        seed = DEFAULT_SEED
    return hash_function(algo)(seed)


def external_hash(digest: bytes) -> int:
    """The int a KV event publishes for a block digest: its low 64 bits (last 8 bytes, big-endian)."""
    return int.from_bytes(digest[-8:], "big") & _LOW64


def salt_extra_keys(cache_salt: str | None) -> tuple[Any, ...] | None:
    """The first block's extra keys for a request's `cache_salt` (vLLM ignores an empty or missing salt)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256_cbor",
    seed: str | None = None,
    first_extra_keys: tuple[Any, ...] | None = None,
    max_blocks: int | None = None,
) -> list[bytes]:
    """The full digests of every *full* block of `token_ids` (a partial tail block is never cached, so never hashed).

    `first_extra_keys` goes into the first block only (e.g. `salt_extra_keys(cache_salt)`); `max_blocks` stops early.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    fn = hash_function(algo)
    parent = none_hash(algo, seed)
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    out: list[bytes] = []
    append = out.append
    extra = first_extra_keys
    for start in range(0, count * block_size, block_size):
        parent = fn((parent, tuple(token_ids[start : start + block_size]), extra))
        append(parent)
        extra = None
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256_cbor",
    seed: str | None = None,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> tuple[int, ...]:
    """The block hashes a vLLM replica publishes in BlockStored events for a prompt of these token ids."""
    digests = block_digests(
        token_ids, block_size, algo=algo, seed=seed, first_extra_keys=salt_extra_keys(cache_salt),
        max_blocks=max_blocks,
    )
    return tuple(int.from_bytes(d[-8:], "big") for d in digests)
