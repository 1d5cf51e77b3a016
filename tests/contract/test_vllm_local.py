"""The local-vLLM tooling itself: the tiny model's tokenizer and the launcher's failure path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from pools.vllm_local import launcher, tiny_model


def test_tiny_tokenizer_is_deterministic_and_has_the_m3_markers(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    rebuilt = tiny_model.build(tmp_path / "again", weights=False)
    assert (rebuilt / "tokenizer.json").read_bytes() == (tiny_tokenizer_dir / "tokenizer.json").read_bytes()

    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    for marker in ("<mm:think>", "</mm:think>", "]<]minimax[>[", "]~!b[", "[e~["):
        assert marker in vocab, f"{marker} must be one token (vLLM's minimax_m3 reasoning parser looks it up)"
    assert 900 <= len(vocab) <= 1100
    # The think markers survive decoding: the reasoning parser works on text.
    ids = tokenizer.encode("a<mm:think>b</mm:think>c").ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<mm:think>b</mm:think>c"

    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    assert "thinking_mode" in config["chat_template"] and "tool_calls" in config["chat_template"]


def test_stamp_marks_a_complete_build(tmp_path: Path) -> None:
    target = tmp_path / "tok"
    assert not tiny_model.is_built(target, weights=False)
    tiny_model.build(target, weights=False)
    assert tiny_model.is_built(target, weights=False)
    assert not tiny_model.is_built(target, weights=True), "a tokenizer-only folder is not a servable model"


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("M3GATE_VLLM_URLS") is not None, reason="external servers: no local launches")
def test_failed_start_raises_with_the_log_tail_and_leaves_nothing(tiny_model_dir: Path) -> None:
    with pytest.raises(launcher.VllmStartError) as failure:
        launcher.start_server(2048, model_dir=tiny_model_dir, extra_args=["--no-such-flag"], timeout=120)
    message = str(failure.value)
    assert "--no-such-flag" in message and "exited" in message
    log_name = message.split("log ", 1)[1].split(":", 1)[0]
    assert Path(log_name).is_file()
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if b"--no-such-flag" in _read(p)], "a process was left"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.vllm
def test_session_servers_publish_kv_events_on_their_own_ports(vllm_servers: list) -> None:
    """Each session server binds its own ZMQ ports (`*` form, reachable on 127.0.0.1) with CBOR block hashes."""
    seen_ports = set()
    for server in vllm_servers:
        sources = httpx.get(f"{server.url}/kv_event_sources", timeout=10).json()
        config = sources["0"]
        assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
        assert config["endpoint"] == f"tcp://*:{server.ports['kv_port']}"
        assert config["replay_endpoint"] == f"tcp://*:{server.ports['kv_replay_port']}"
        seen_ports |= {server.ports["kv_port"], server.ports["kv_replay_port"]}
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'prefix_caching_hash_algo="sha256_cbor"' in metrics
    assert len(seen_ports) == 2 * len(vllm_servers)
