"""vLLM's prefix-cache block hashes reproduced in the gateway: the contract's test vectors, and values computed by
vLLM 0.32's own `hash_block_tokens` (sha256_cbor, sha256/pickle, cache_salt) pinned here."""

from __future__ import annotations

import pytest

from policies.vllm_hash import block_digests, block_hashes, external_hash, none_hash, salt_extra_keys

BLOCK_1_16 = list(range(1, 17))
BLOCK_17_32 = list(range(17, 33))


def test_none_hash_matches_the_contract_vector() -> None:
    assert none_hash().hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"


def test_first_blocks_match_the_contract_vectors() -> None:
    digests = block_digests(BLOCK_1_16 + BLOCK_17_32, 16)
    assert digests[0].hex().startswith("cd7c51bc") and digests[0].hex().endswith("7fd01682")
    assert block_hashes(BLOCK_1_16 + BLOCK_17_32, 16) == (8866452693264111234, 807986237951177663)
    assert external_hash(digests[0]) == 8866452693264111234  # the low 64 bits, big-endian: what events publish


def test_only_full_blocks_are_hashed_and_each_chains_on_its_parent() -> None:
    assert block_hashes(list(range(1, 16)), 16) == ()  # 15 tokens: no full block, nothing cached by vLLM
    assert block_hashes(BLOCK_1_16 + BLOCK_17_32 + [7, 8, 9], 16) == (8866452693264111234, 807986237951177663)
    # the second block hashes differently behind another first block, though its own tokens are the same
    assert block_hashes([0] * 16 + BLOCK_17_32, 16)[1] != 807986237951177663


def test_cache_salt_goes_into_the_first_block_only_and_changes_the_whole_chain() -> None:
    # values from vLLM's hash_block_tokens(sha256_cbor, ..., (("cache_salt", "abc"),)) then (..., None)
    salted = block_hashes(BLOCK_1_16 + BLOCK_17_32, 16, cache_salt="abc")
    assert salted == (1845123984349157862, 13474607813485410443)
    assert salt_extra_keys("abc") == (("cache_salt", "abc"),)
    assert salt_extra_keys("") is None and block_hashes(BLOCK_1_16, 16, cache_salt="") == (8866452693264111234,)
    second_alone = block_digests(BLOCK_17_32, 16, first_extra_keys=None)
    assert second_alone != block_digests(BLOCK_17_32, 16, first_extra_keys=salt_extra_keys("abc"))


def test_pickle_sha256_the_vllm_default_is_reproducible_in_python() -> None:
    assert block_hashes(BLOCK_1_16 + BLOCK_17_32, 16, algo="sha256") == (1403909460543360175, 1643945449041937783)


def test_pythonhashseed_changes_the_seed_and_xxhash_needs_one() -> None:
    seeded = block_hashes(BLOCK_1_16, 16, seed="0")
    assert seeded != block_hashes(BLOCK_1_16, 16)
    assert none_hash("sha256_cbor", "0") != none_hash()
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        block_hashes(BLOCK_1_16, 16, algo="xxhash_cbor")
    assert len(block_hashes(BLOCK_1_16, 16, algo="xxhash_cbor", seed="42")) == 1
    with pytest.raises(ValueError, match="unsupported"):
        block_hashes(BLOCK_1_16, 16, algo="md5")


def test_max_blocks_stops_early_with_the_same_prefix() -> None:
    ids = list(range(128 * 5))
    assert block_hashes(ids, 128, max_blocks=2) == block_hashes(ids, 128)[:2]
