"""`m3gate pools render` for a disaggregated pool: each role's `vllm serve` command, flag for flag the pool's recipe
plus vLLM's `--kv-transfer-config` (NixlConnector, kv_producer / kv_consumer, the lease the gateway assumes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies.config import ConfigError, parse_config
from policies.launch import OWNED_FLAGS, LaunchError, render, render_config

CONFIG = """\
model: MiniMaxAI/MiniMax-M3
pools:
  - name: interactive
    max_model_len: 32768
    endpoints: ["http://127.0.0.1:8001"]
    launch: {hardware: h200}
  - name: extended
    max_model_len: 1048576
    launch: {hardware: h200, replicas: 2}
    disaggregation:
      prefill: {endpoints: ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}
      decode:
        endpoints: ["http://10.0.1.1:8000"]
        launch: {hardware: h200, replicas: 1, speculative_decoding: true, draft_head: gqa, port: 8100}
      kv_lease_s: 45
"""


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_role_gets_its_command() -> None:
    cfg = parse_config(CONFIG, env={})
    commands = render(cfg.pools[1], cfg.model)
    assert [(c.role, c.replica, c.name) for c in commands] == [
        ("prefill", 0, "extended-prefill-0"), ("prefill", 1, "extended-prefill-1"), ("decode", 0, "extended-decode-0")]
    for c in commands:
        transfer = json.loads(flag(c.argv, "--kv-transfer-config"))
        assert transfer == {"kv_connector": "NixlConnector",
                            "kv_role": "kv_producer" if c.role == "prefill" else "kv_consumer",
                            "kv_connector_extra_config": {"kv_lease_duration": 45}}
        assert c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert flag(c.argv, "--max-model-len") == "1048576" and flag(c.argv, "--block-size") == "128"
        assert flag(c.argv, "--kv-cache-dtype") == "fp8"  # the recipe's, past the native context
    prefill, _, decode = commands
    assert "--speculative-config" not in prefill.argv and "--speculative-config" in decode.argv
    assert flag(prefill.argv, "--port") == "8000" and flag(decode.argv, "--port") == "8100"
    plain = render(cfg.pools[0], cfg.model)
    assert plain[0].role == "" and plain[0].name == "interactive-0" and "--kv-transfer-config" not in plain[0].argv
    assert "--kv-transfer-config" in OWNED_FLAGS
    assert [c.name for c in render_config(cfg)][:1] == ["interactive-0"]


def test_a_role_without_any_launch_is_refused() -> None:
    text = CONFIG.replace("    launch: {hardware: h200, replicas: 2}\n", "")
    cfg = parse_config(text, env={})
    with pytest.raises(LaunchError, match="disaggregation.prefill.launch"):
        render(cfg.pools[1], cfg.model)
    assert [c.name for c in render_config(cfg)] == ["interactive-0"]  # not renderable: skipped in the full render


def test_a_role_launch_is_checked_against_the_pool_by_line() -> None:
    text = CONFIG.replace("draft_head: gqa, port: 8100}", "draft_head: gqa, port: 8100, text_only: true}")
    text = text.replace("    max_model_len: 1048576\n", "    max_model_len: 1048576\n    modalities: [text, image]\n")
    with pytest.raises(ConfigError) as info:
        parse_config(text, "pools.yaml", env={})
    assert "line 7: pools.1: Value error, text_only on a pool accepting text, image" in str(info.value)


def test_cli_renders_roles(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(CONFIG)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "pools", "render", str(path), "--pool", "extended",
                          "--format", "json"], capture_output=True, text=True, cwd=root, check=True).stdout
    assert [c["role"] for c in json.loads(out)] == ["prefill", "prefill", "decode"]
