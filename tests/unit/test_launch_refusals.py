"""Launch specs the recipe rules out are refused when the pool file is loaded, with the recipe's reason and the
line, and `m3gate pools render` prints what `render()` gives."""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.commands import main
from policies.config import ConfigError, parse_config
from policies.launch import render

POOL_FILE = """\
model: MiniMaxAI/MiniMax-M3
pools:
  - name: short
    max_model_len: 32768
    launch:
      hardware: h200
      variant: mxfp8
      tensor_parallel_size: 4
      replicas: 2
  - name: long
    max_model_len: 262144
    modalities: [text, image]
    launch:
      hardware: h200
      kv_events: true
  - name: static
    max_model_len: 65536
    endpoints: [http://10.0.0.9:8000]
"""


def _config(launch: dict[str, Any], *, max_model_len: int = 131072, modalities: list[str] | None = None,
            block_size: int = 128) -> str:
    pool: dict[str, Any] = {"name": "p", "max_model_len": max_model_len, "block_size": block_size, "launch": launch}
    if modalities is not None:
        pool["modalities"] = modalities
    return json.dumps({"model": "MiniMaxAI/MiniMax-M3", "pools": [pool]})  # JSON is YAML


REFUSALS = [
    # (id, launch, pool overrides, words of the recipe the message must quote)
    ("text-only-with-encoder-parallel", {"hardware": "h200", "text_only": True, "encoder_parallel": True}, {},
     "mutually exclusive with Encoder Parallel"),
    ("encoder-parallel-on-text-pool", {"hardware": "h200", "encoder_parallel": True}, {"modalities": ["text"]},
     "mutually exclusive with Encoder Parallel"),
    ("nvfp4-on-mi355x", {"hardware": "mi355x", "variant": "nvfp4"}, {}, "NVFP4 on Blackwell"),
    ("nvfp4-on-mi300x", {"hardware": "mi300x", "variant": "nvfp4"}, {}, "NVFP4 on Blackwell"),
    ("nvfp4-on-hopper", {"hardware": "h200", "variant": "nvfp4"}, {}, "NVFP4 on Blackwell"),
    ("mxfp4-on-mi300x", {"hardware": "mi300x", "variant": "mxfp4"}, {}, "targets AMD Instinct MI355X (gfx950)"),
    ("mxfp4-on-b200", {"hardware": "b200", "variant": "mxfp4"}, {}, "targets AMD Instinct MI355X (gfx950)"),
    ("amd-bf16-tp4", {"hardware": "mi355x", "tensor_parallel_size": 4}, {}, "BF16 needs TP=8"),
    ("amd-mxfp8-tp2", {"hardware": "mi325x", "variant": "mxfp8", "tensor_parallel_size": 2}, {},
     "the MXFP8 variant runs from TP=4"),
    ("ptpc-on-mxfp8", {"hardware": "mi300x", "variant": "mxfp8", "online_quantization": "fp8_per_channel"}, {},
     "for the BF16 checkpoint only"),
    ("ptpc-on-nvidia", {"hardware": "h200", "online_quantization": "fp8_per_channel"}, {},
     "for the BF16 checkpoint only"),
    ("high-concurrency-on-mi300x", {"hardware": "mi300x", "variant": "mxfp8", "high_concurrency": True}, {},
     "MXFP8 high-concurrency options on MI355X"),
    ("block-size-16", {"hardware": "h200"}, {"block_size": 16}, "--block-size 128 is mandatory on every platform"),
    ("past-1m", {"hardware": "mi355x"}, {"max_model_len": 2_097_152}, "context_length: 1048576"),
    ("gb200-tp8-spans-trays", {"hardware": "gb200", "variant": "nvfp4"}, {}, "multi-node strategies"),
    ("text-only-on-image-pool", {"hardware": "h200", "text_only": True}, {"modalities": ["text", "image"]},
     "--language-model-only"),
    ("extra-args-fight-the-recipe", {"hardware": "h200", "extra_args": ["--block-size", "16"]}, {}, "--block-size"),
    ("extra-env-overrides-amd-env", {"hardware": "mi300x", "extra_env": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}}, {},
     "VLLM_USE_BREAKABLE_CUDAGRAPH"),
    ("hash-seed-breaks-kv-events", {"hardware": "h200", "kv_events": True, "extra_env": {"PYTHONHASHSEED": "0"}}, {},
     "PYTHONHASHSEED"),
    ("draft-without-spec-decoding", {"hardware": "b200", "draft_head": "gqa"}, {}, "speculative_decoding is off"),
    ("unknown-key", {"hardware": "h200", "tensor_parallel": 8}, {}, "Extra inputs are not permitted"),
]


@pytest.mark.parametrize(("launch", "overrides", "reason"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_recipe_incompatibilities_are_refused_at_load_with_the_reason(
    launch: dict[str, Any], overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_config(launch, **overrides), env={})
    assert reason in str(err.value)


def test_neighbours_of_the_refusals_are_accepted() -> None:
    """The refusals are narrow: the documented alternatives next to them load."""
    for launch, overrides in [
        ({"hardware": "mi355x", "variant": "mxfp8", "tensor_parallel_size": 4}, {}),  # "runs from TP=4"
        ({"hardware": "gb200", "variant": "nvfp4", "tensor_parallel_size": 4}, {}),  # one worker per 4-GPU tray
        ({"hardware": "h200", "text_only": True}, {"modalities": ["text"]}),
        ({"hardware": "h200", "encoder_parallel": False}, {"modalities": ["text"]}),
        ({"hardware": "mi355x"}, {"max_model_len": 1_048_576}),
    ]:
        parse_config(_config(launch, **overrides), env={})


def test_config_check_names_the_line_of_the_bad_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = POOL_FILE.replace("      kv_events: true\n", "      variant: mxfp4\n")
    path = tmp_path / "pools.yaml"
    path.write_text(bad)
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    lines = bad.splitlines()
    launch_line = lines.index("    launch:", lines.index("  - name: long")) + 1  # the long pool's `launch:` key
    assert f"line {launch_line}: pools.1.launch" in err
    assert "targets AMD Instinct MI355X (gfx950)" in err


def test_pools_render_json_matches_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(POOL_FILE)
    assert main(["pools", "render", str(path), "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    cfg = parse_config(POOL_FILE, env={})
    expected = [c for p in cfg.pools if p.launch is not None for c in render(p, cfg.model)]
    assert [(c["pool"], c["replica"]) for c in printed] == [("short", 0), ("short", 1), ("long", 0)]
    assert [c["argv"] for c in printed] == [c.argv for c in expected]
    assert [c["env"] for c in printed] == [c.env for c in expected]
    assert printed[2]["kv_events_ports"] == [5557]


def test_pools_render_shell_for_one_pool_is_runnable_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(POOL_FILE)
    assert main(["pools", "render", str(path), "--pool", "long"]) == 0
    out = capsys.readouterr().out
    body = [line for line in out.splitlines() if not line.startswith("#")]
    tokens = shlex.split("\n".join(body).replace("\\\n", " "))
    cfg = parse_config(POOL_FILE, env={})
    (cmd,) = render(cfg.pools[1], cfg.model)
    assert tokens == cmd.argv
    assert "long, replica 0" in out and "short" not in out


@pytest.mark.parametrize(("pool", "message"), [("nope", "no pool named 'nope'"), ("static", "no `launch:` section")])
def test_pools_render_explains_a_pool_it_cannot_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pool: str, message: str
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(POOL_FILE)
    assert main(["pools", "render", str(path), "--pool", pool]) == 1
    assert message in capsys.readouterr().err


def test_pools_render_reports_an_invalid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(textwrap.dedent(POOL_FILE).replace("variant: mxfp8", "variant: nvfp4"))
    assert main(["pools", "render", str(path)]) == 1
    assert "NVFP4 on Blackwell" in capsys.readouterr().err
