"""API keys: hashed storage, both SDKs' headers, OpenAI-shaped 401s; config checks that keep keys, classes, pools and
the admin key consistent; header size and the body deadline."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest

from gateway.access import ANONYMOUS, KeyStore, body_deadline, check_header_size, presented_key
from policies.errors import RequestRejected
from policies.config import ApiKeyConfig, ConfigError, parse_config


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


ALICE = ApiKeyConfig(name="alice", key_sha256=_sha("sk-alice-0123456789"))
BOB = ApiKeyConfig(name="bob", key_sha256=_sha("sk-bob-0123456789").upper())  # hex case does not matter


def test_keys_are_found_by_hash_from_either_sdk_header() -> None:
    store = KeyStore([ALICE, BOB])
    assert store.authenticate({"authorization": "Bearer sk-alice-0123456789"}).name == "alice"
    assert store.authenticate({"authorization": "bearer sk-bob-0123456789"}).name == "bob"
    assert store.authenticate({"x-api-key": "sk-bob-0123456789"}).name == "bob"
    client = store.authenticate({"x-api-key": "sk-alice-0123456789"})
    assert client.key_id == ALICE.key_sha256[:16] and "sk-alice" not in client.key_id


def test_missing_or_wrong_keys_get_openai_shaped_401s() -> None:
    store = KeyStore([ALICE])
    with pytest.raises(RequestRejected) as missing:
        store.authenticate({})
    with pytest.raises(RequestRejected) as wrong:
        store.authenticate({"authorization": "Bearer sk-mallory-0123456789"})
    for exc in (missing.value, wrong.value):
        assert exc.status == 401 and exc.code == "invalid_api_key" and exc.type == "invalid_request_error"
    assert "Authorization: Bearer" in missing.value.message and "x-api-key" in missing.value.message
    assert "sk-mallory-0123456789" not in wrong.value.message  # masked, as OpenAI does
    assert "sk-...6789" in wrong.value.message
    with pytest.raises(RequestRejected):
        store.authenticate({"authorization": "Basic c2stYWxpY2U="})


def test_an_open_gateway_lets_everyone_in_as_anonymous() -> None:
    store = KeyStore([])
    assert store.open
    assert store.authenticate({}) is ANONYMOUS
    assert ANONYMOUS.name == "anonymous" and ANONYMOUS.key_id == ""


def test_presented_key_prefers_authorization() -> None:
    assert presented_key({"authorization": "Bearer  a ", "x-api-key": "b"}) == "a"
    assert presented_key({"authorization": "Bearer ", "x-api-key": "b"}) is None
    assert presented_key({"x-api-key": " b "}) == "b"
    assert presented_key({}) is None


def test_headers_larger_than_the_limit_get_a_431() -> None:
    check_header_size([(b"a", b"b" * 90)], 100)
    with pytest.raises(RequestRejected) as refused:
        check_header_size([(b"cookie", b"x" * 200)], 100)
    assert refused.value.status == 431 and "at most 100" in refused.value.message


async def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    async with body_deadline(1.0):
        await asyncio.sleep(0)
    with pytest.raises(RequestRejected) as refused:
        async with body_deadline(0.02):
            await asyncio.sleep(1)
    assert refused.value.status == 408 and refused.value.code == "request_timeout"


# config ------------------------------------------------------------------------------------------------------------

BASE = """
model: m
pools:
  - {name: interactive, max_model_len: 8192}
  - {name: repository, max_model_len: 65536}
"""


def _parse(extra: str) -> Any:
    return parse_config(BASE + extra, env={})


def test_keys_from_the_config_and_a_keys_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"keys:\n  - {{name: ci, key_sha256: {_sha('ci')}, pools: [repository]}}\n")
    cfg = _parse(f"""
access:
  keys_file: {keys_file}
  keys:
    - name: alice
      key_sha256: {_sha('a')}
      traffic_class: interactive
      requests_per_minute: 60
""")
    assert [k.name for k in cfg.access.all_keys()] == ["alice", "ci"]
    keys_file.write_text(f"- {{name: ci2, key_sha256: {_sha('ci2')}}}\n")  # a bare list works too
    assert [k.name for k in _parse(f"access: {{keys_file: {keys_file}}}").access.all_keys()] == ["ci2"]


@pytest.mark.parametrize(("extra", "expected"), [
    ("access: {keys_file: /nonexistent/keys.yaml}", "cannot read keys_file"),
    (f"access: {{keys: [{{name: a, key_sha256: {_sha('x')}, traffic_class: vip}}]}}", "unknown traffic class"),
    (f"access: {{keys: [{{name: a, key_sha256: {_sha('x')}, pools: [huge]}}]}}", "unknown pool"),
    (f"access: {{keys: [{{name: a, key_sha256: {_sha('x')}}}, {{name: a, key_sha256: {_sha('y')}}}]}}", "unique"),
    ("access: {keys: [{name: a, key_sha256: not-a-hash}]}", "key_sha256"),
    (f"admin: {{api_key: same}}\naccess: {{keys: [{{name: a, key_sha256: {_sha('same')}}}]}}", "admin.api_key"),
    ("traffic: {pool_classes: {interactive: vip}}", "unknown traffic class"),
    ("traffic: {pool_classes: {huge: interactive}}", "pool 'huge'"),
    ("traffic: {classes: {interactive: {max_concurrency: 0}}}", "max_concurrency"),
    ("traffic: {classes: {}}", "at least one traffic class"),
    ("limits: {body_read_timeout_s: -1}", "body_read_timeout_s"),
])
def test_inconsistent_traffic_and_access_config_is_refused(extra: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(extra)
    assert expected in "\n".join(err.value.problems)


def test_a_bad_keys_file_entry_is_located(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- {{name: ok, key_sha256: {_sha('ok')}}}\n- {{name: bad, key_sha256: nope}}\n")
    with pytest.raises(ConfigError) as err:
        _parse(f"access: {{keys_file: {keys_file}}}")
    assert "entry 1" in err.value.problems[0] and "key_sha256" in err.value.problems[0]


def test_configs_differ_when_only_the_keys_file_changed(tmp_path: Path) -> None:
    """A reload must notice a new key in the keys file even though the config file itself did not change."""
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- {{name: a, key_sha256: {_sha('a')}}}\n")
    first = _parse(f"access: {{keys_file: {keys_file}}}")
    keys_file.write_text(f"- {{name: a, key_sha256: {_sha('a')}}}\n- {{name: b, key_sha256: {_sha('b')}}}\n")
    assert _parse(f"access: {{keys_file: {keys_file}}}") != first
