"""The `disaggregation` section of a pool: validated whole with the rest, errors by line, mixed with plain pools;
the runtime's replicas carry their role."""

from __future__ import annotations

import pytest

from policies.config import ConfigError, parse_config
from pools.replicas import PoolRuntime

MIXED = """\
model: MiniMaxAI/MiniMax-M3
pools:
  - name: interactive
    max_model_len: 32768
    endpoints: ["http://127.0.0.1:8001"]
  - name: extended
    max_model_len: 1048576
    disaggregation:
      prefill: {endpoints: ["http://127.0.0.1:8101", "http://127.0.0.1:8102/"]}
      decode:
        endpoints: ["http://127.0.0.1:8201"]
      connector: nixl
      min_uncached_tokens: 8192
"""


def test_mixed_pools_parse_with_roles() -> None:
    cfg = parse_config(MIXED, env={})
    plain, extended = cfg.pools
    assert plain.disaggregation is None
    d = extended.disaggregation
    assert d is not None and d.connector == "nixl" and d.min_uncached_tokens == 8192
    assert d.prefill.endpoints == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert d.transfer_timeout_s == 60.0 and d.kv_lease_s == 30.0
    runtime = PoolRuntime.from_config(extended)
    assert {u: r.role for u, r in runtime.replicas.items()} == {
        "http://127.0.0.1:8101": "prefill", "http://127.0.0.1:8102": "prefill", "http://127.0.0.1:8201": "decode"}
    assert [s.url for s in runtime.snapshots(0.0)] == ["http://127.0.0.1:8201"]  # what clients are sent to
    assert [s.url for s in runtime.snapshots(0.0, role="prefill")] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert len(runtime.snapshots(0.0, role=None)) == 3
    for r in runtime.of_role("serving"):
        r.healthy = False
    assert not runtime.available(0.0)  # prefill replicas alone cannot answer a client
    assert PoolRuntime.from_config(plain).snapshots(0.0)[0].url == "http://127.0.0.1:8001"


def test_reload_keeps_replica_state_and_roles() -> None:
    cfg = parse_config(MIXED, env={})
    first = PoolRuntime.from_config(cfg.pools[1])
    first.replicas["http://127.0.0.1:8101"].in_flight = 3
    again = PoolRuntime.from_config(cfg.pools[1], first)
    assert again.replicas["http://127.0.0.1:8101"].in_flight == 3
    assert again.replicas["http://127.0.0.1:8101"].role == "prefill"


def test_discovery_per_role() -> None:
    text = MIXED.replace('prefill: {endpoints: ["http://127.0.0.1:8101", "http://127.0.0.1:8102/"]}',
                         "prefill: {discovery: {dns_name: vllm-prefill.m3gate.svc.cluster.local}}")
    cfg = parse_config(text, env={})
    runtime = PoolRuntime.from_config(cfg.pools[1])
    assert set(runtime.discovery_specs()) == {"prefill"}
    runtime.apply_discovery({"http://10.0.0.7:8000"}, set(), "prefill")
    assert runtime.replicas["http://10.0.0.7:8000"].role == "prefill"
    kept = PoolRuntime.from_config(cfg.pools[1], runtime)  # same discovery: the found replica stays, with its role
    assert kept.replicas["http://10.0.0.7:8000"].role == "prefill"
    kept.apply_discovery(set(), {"http://10.0.0.7:8000"}, "prefill")
    assert "http://10.0.0.7:8000" not in kept.replicas


@pytest.mark.parametrize(
    ("old", "new", "line", "fragment"),
    [
        ("connector: nixl", "connector: mooncake", 12, "pools.1.disaggregation.connector"),
        ("min_uncached_tokens: 8192", "min_uncached_tokens: -1", 13, "pools.1.disaggregation.min_uncached_tokens"),
        ('endpoints: ["http://127.0.0.1:8201"]', 'endpoints: ["127.0.0.1:8201"]', 11, "must start with http://"),
        ('endpoints: ["http://127.0.0.1:8201"]', "endpoints: []", 10, "list the role's endpoints or give its "
         "discovery"),
        ('endpoints: ["http://127.0.0.1:8201"]', 'endpoints: ["http://127.0.0.1:8101"]', 8, "either prefill or "
         "decode"),
        ("    disaggregation:\n", '    endpoints: ["http://127.0.0.1:8003"]\n    disaggregation:\n', 6,
         "not in endpoints or discovery"),
        ("      connector: nixl\n", "      connector: nixl\n      prefil_timeout_s: 3\n", 13, "prefil_timeout_s"),
    ],
)
def test_errors_name_the_field_and_its_line(old: str, new: str, line: int, fragment: str) -> None:
    assert old in MIXED
    with pytest.raises(ConfigError) as info:
        parse_config(MIXED.replace(old, new), "pools.yaml", env={})
    message = str(info.value)
    assert fragment in message and f"line {line}:" in message, message
