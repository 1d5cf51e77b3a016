"""The pool file: one pydantic model, errors located by YAML line, env overrides, the committed JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies.config import ConfigError, json_schema, load_config, parse_config

GOOD = """\
model: MiniMaxAI/MiniMax-M3
aliases: [minimax-m3]
pools:
  - name: interactive
    max_model_len: 32768
    modalities: [text, image, video]
    endpoints: ["http://127.0.0.1:8001/"]
  - name: extended
    max_model_len: 1048576
    endpoints: ["http://127.0.0.1:8003"]
  - name: repository
    max_model_len: 131072
    endpoints: ["http://127.0.0.1:8002"]
"""


def test_good_config_parses_and_orders_pools_by_size() -> None:
    cfg = parse_config(GOOD, env={})
    assert [p.name for p in cfg.pools_by_size()] == ["interactive", "repository", "extended"]
    assert cfg.pools[0].endpoints == ["http://127.0.0.1:8001"]  # trailing slash trimmed
    assert cfg.served_model_ids() == ["MiniMaxAI/MiniMax-M3", "minimax-m3"]
    assert cfg.routing.policy == "prefix_affinity"


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        (GOOD.replace("max_model_len: 131072", "max_model_len: -5"), 12, "pools.2.max_model_len"),
        (GOOD.replace("modalities: [text, image, video]", "modalities: [text, smell]"), 6, "pools.0.modalities"),
        (GOOD.replace('"http://127.0.0.1:8003"', '"127.0.0.1:8003"'), 10, "must start with http://"),
        (GOOD + "rooting:\n  policy: round_robin\n", 14, "rooting"),
        (GOOD.replace("name: extended", "name: interactive"), None, "unique"),
    ],
)
def test_errors_name_the_field_and_its_line(text: str, line: int | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "pools.yaml", env={})
    message = str(info.value)
    assert fragment in message
    if line is not None:
        assert f"line {line}:" in message


def test_malformed_yaml_says_where() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("model: x\npools: [\n  - name: a\n", "pools.yaml", env={})
    assert "not valid YAML" in str(info.value) and "line" in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "cannot read" in str(info.value)


def test_environment_overrides_address_and_secrets() -> None:
    env = {"M3GATE_HOST": "0.0.0.0", "M3GATE_PORT": "9000", "M3GATE_POOL_EXTENDED_API_KEY": "s3cret",
           "M3GATE_STATE": "redis://127.0.0.1:6379/3"}
    cfg = parse_config(GOOD, env=env)
    assert (cfg.server.host, cfg.server.port, cfg.state) == ("0.0.0.0", 9000, "redis://127.0.0.1:6379/3")
    keys = {p.name: p.api_key for p in cfg.pools}
    assert keys["extended"] is not None and keys["extended"].get_secret_value() == "s3cret"
    assert keys["interactive"] is None
    assert "s3cret" not in repr(cfg) and "s3cret" not in cfg.model_dump_json()


def test_config_check_cli_exit_codes(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("max_model_len: 32768", "max_model_len: lots"))
    ok = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", str(good)], capture_output=True,
                        text=True)
    assert ok.returncode == 0 and "interactive (32768 tokens" in ok.stdout
    fail = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", str(bad)], capture_output=True,
                          text=True)
    assert fail.returncode == 1 and "line 5: pools.0.max_model_len" in fail.stderr


def test_committed_schema_is_current() -> None:
    committed = Path(__file__).parents[2] / "deploy" / "m3gate.schema.json"
    assert json.loads(committed.read_text()) == json_schema(), "run `make schema` to refresh deploy/m3gate.schema.json"
