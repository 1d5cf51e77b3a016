"""Every command the MiniMax-M3 vLLM recipe documents, pasted verbatim, against what `policies.launch.render` gives.

The recipe text is the oracle: each row holds a bash block copied from shared/seeds/minimax-m3-vllm-recipe.md
(and the deployment guide) and the launch spec that should reproduce it. A rendered command must carry every
flag and value of the block, exactly the block's environment, the same checkpoint, and beyond that only the flags
the gateway adds, with values this test computes on its own.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import pytest

from policies.config import GatewayConfig, PoolConfig
from policies.launch import render

SERVED = "MiniMaxAI/MiniMax-M3"
MULTIMODAL = ["text", "image", "video"]
TEXT = ["text"]

# "On AMD MI300X / MI325X / MI355X, run with CUDA graphs and set the following before any of the serve commands below."
AMD_PREAMBLE = "export VLLM_USE_BREAKABLE_CUDAGRAPH=0\n"

JSON_FLAGS = {"--speculative-config", "--hf-overrides", "--kv-events-config"}
PARSERS = {"--tool-call-parser": "minimax_m3", "--reasoning-parser": "minimax_m3", "--enable-auto-tool-choice": True}


@dataclass(frozen=True)
class Row:
    id: str
    recipe: str
    launch: dict[str, Any]
    max_model_len: int = 131072
    modalities: list[str] = field(default_factory=lambda: list(MULTIMODAL))
    image: str | None = None


def parse_recipe(text: str, max_model_len: int) -> tuple[dict[str, str], str, dict[str, Any]]:
    """(environment, model, {flag: value or True}) of a recipe bash block."""
    text = text.replace("\\\n", " ").replace('"$MAX_MODEL_LEN"', str(max_model_len))
    tokens = shlex.split(text, comments=True)
    env: dict[str, str] = {}
    i = 0
    while tokens[i] != "vllm":
        tok = tokens[i]
        if tok == "export":
            i += 1
            continue
        key, value = tok.split("=", 1)
        env[key] = re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", value)  # "${NCCL_MIN_NCHANNELS:-112}" -> its default
        i += 1
    assert tokens[i + 1] == "serve"
    model = tokens[i + 2]
    return env, model, parse_flags(tokens[i + 3:])


def parse_flags(tokens: list[str]) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        assert flag.startswith("--"), f"stray token {flag!r}"
        assert flag not in flags, f"{flag} given twice"
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value: Any = tokens[i + 1]
            flags[flag] = json.loads(value) if flag in JSON_FLAGS else value
            i += 2
        else:
            flags[flag] = True
            i += 1
    return flags


def gateway_additions(max_model_len: int, checkpoint: str) -> dict[str, Any]:
    """Flags a rendered command may carry beyond the recipe block, with the values the gateway needs."""
    added: dict[str, Any] = {
        "--max-model-len": str(max_model_len),
        "--port": "8000",
        "--enable-prefix-caching": True,
        "--enable-prompt-tokens-details": True,
        "--enable-server-load-tracking": True,
        "--shutdown-timeout": "60",  # finish the streams in flight on SIGTERM (launch.shutdown_timeout_s' default)
        **PARSERS,  # "Keep --tool-call-parser minimax_m3, --reasoning-parser minimax_m3, and --enable-auto-tool-choice"
    }
    if checkpoint != SERVED:
        added["--served-model-name"] = SERVED  # clients keep sending the gateway's model id
    return added


ROWS = [
    # ---- "Serve" section: the configuration the page was rendered for (h200, single_node_tp, BF16)
    Row("serve-h200-bf16-tp8", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --block-size 128 \\
  --max-model-len 65536 \\
  --tensor-parallel-size 8 \\
  --tool-call-parser minimax_m3 \\
  --enable-auto-tool-choice \\
  --reasoning-parser minimax_m3
""", {"hardware": "h200"}, max_model_len=65536, image="vllm/vllm-openai:minimax-m3"),
    # ---- NVIDIA TP8 (8x H200 / H20), TP8 + EP, DP8 + EP
    *[Row(f"nvidia-tp8-{hw}", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": hw}, image="vllm/vllm-openai:minimax-m3") for hw in ("h200", "b200", "b300")],
    Row("nvidia-tp8-ep", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --enable-expert-parallel \\
  --block-size 128 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "h200", "expert_parallel": True}),
    Row("nvidia-dp8-ep", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --data-parallel-size 8 \\
  --enable-expert-parallel \\
  --block-size 128 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "h200", "tensor_parallel_size": 1, "data_parallel_size": 8, "expert_parallel": True}),
    # ---- AMD TP8 (Text or Vision), multimodal, on each AMD part
    *[Row(f"amd-tp8-vision-{hw}", AMD_PREAMBLE + """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend ROCM_AITER_FA \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": hw}, image="vllm/vllm-openai-rocm:nightly") for hw in ("mi300x", "mi325x", "mi355x")],
    # AMD TP8, text: the same block without "the vision-encoder flags (... for multimodal serving)", plus
    # "For text-only workloads enable Text only (--language-model-only)".
    Row("amd-tp8-text", AMD_PREAMBLE + """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --language-model-only \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi300x"}, modalities=TEXT),
    # ---- AMD TP8 + --quantization fp8_per_channel (BF16 checkpoint only)
    *[Row(f"amd-tp8-ptpc-{hw}", """
export VLLM_USE_BREAKABLE_CUDAGRAPH=0
export VLLM_ROCM_USE_AITER=1
export VLLM_ROCM_USE_AITER_MOE=0

vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --quantization fp8_per_channel \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": hw, "online_quantization": "fp8_per_channel", "encoder_parallel": False})
      for hw in ("mi300x", "mi355x")],
    # ---- AMD TP8 + EP, DP8 + EP
    Row("amd-tp8-ep", AMD_PREAMBLE + """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --enable-expert-parallel \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend ROCM_AITER_FA \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi325x", "expert_parallel": True}),
    Row("amd-dp8-ep", AMD_PREAMBLE + """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --data-parallel-size 8 \\
  --enable-expert-parallel \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend ROCM_AITER_FA \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi355x", "tensor_parallel_size": 1, "data_parallel_size": 8, "expert_parallel": True}),
    # ---- FP8 KV cache: "Add --kv-cache-dtype fp8 to any command"
    Row("nvidia-tp8-fp8-kv", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --kv-cache-dtype fp8 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "h200", "kv_cache_dtype": "fp8"}),
    # ---- Context Length & GPU Memory: cap with --max-model-len
    Row("context-cap-128k", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --max-model-len 131072        # 128K instead of the full 1M
""", {"hardware": "h200"}, max_model_len=131072),
    # ---- AMD past the 512K native context: YaRN on the text config, long max length, fp8 KV
    *[Row(f"amd-1m-yarn-{hw}", AMD_PREAMBLE + """
VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 \\
  vllm serve MiniMaxAI/MiniMax-M3 \\
  --block-size 128 \\
  --kv-cache-dtype fp8 \\
  --tensor-parallel-size 8 \\
  --max-model-len 1048576 \\
  --attention-backend TRITON_ATTN \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend ROCM_AITER_FA \\
  --tool-call-parser minimax_m3 \\
  --enable-auto-tool-choice \\
  --reasoning-parser minimax_m3 \\
  --hf-overrides '{"text_config":{"rope_scaling":{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":524288}}}'
""", {"hardware": hw}, max_model_len=1048576) for hw in ("mi300x", "mi355x")],
    # ---- Quantized Variant (MXFP8), NVIDIA
    *[Row(f"mxfp8-tp8-{hw}", """
vllm serve MiniMaxAI/MiniMax-M3-MXFP8 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": hw, "variant": "mxfp8"}) for hw in ("h200", "b200", "b300")],
    # ---- MXFP8 on MI300X (InferenceX MI300X tuning), text only
    Row("mxfp8-mi300x", """
export VLLM_ENGINE_READY_TIMEOUT_S=3600
export VLLM_USE_BREAKABLE_CUDAGRAPH=0
export VLLM_ROCM_USE_AITER=1
export VLLM_ROCM_USE_AITER_MHA=0
export TORCH_BLAS_PREFER_HIPBLASLT=1
export NCCL_MIN_NCHANNELS="${NCCL_MIN_NCHANNELS:-112}"
export GPU_MAX_HW_QUEUES="${GPU_MAX_HW_QUEUES:-2}"

vllm serve MiniMaxAI/MiniMax-M3-MXFP8 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --language-model-only \\
  --max-model-len "$MAX_MODEL_LEN" \\
  --attention-backend TRITON_ATTN \\
  --async-scheduling \\
  --max-num-batched-tokens 16384 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi300x", "variant": "mxfp8"}, max_model_len=65536, modalities=TEXT),
    # ---- MXFP8 on MI355X, default serving configuration (nightly ROCm image)
    Row("mxfp8-mi355x", """
export VLLM_USE_BREAKABLE_CUDAGRAPH=0
export VLLM_ROCM_USE_AITER=1
export VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1
export VLLM_ROCM_QUICK_REDUCE_QUANTIZATION=INT4

vllm serve MiniMaxAI/MiniMax-M3-MXFP8 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi355x", "variant": "mxfp8", "encoder_parallel": False}, image="vllm/vllm-openai-rocm:nightly"),
    # ---- MXFP8 high-concurrency options on MI355X (long context + high concurrency only)
    Row("mxfp8-mi355x-high-concurrency", """
export VLLM_USE_BREAKABLE_CUDAGRAPH=0
export VLLM_ROCM_USE_AITER=1
export VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1
export VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1
export VLLM_ROCM_QUICK_REDUCE_QUANTIZATION=INT4
export VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16=0
export VLLM_ROCM_QUICK_REDUCE_QUANTIZATION_MIN_SIZE_KB=256

vllm serve MiniMaxAI/MiniMax-M3-MXFP8 \\
  --tensor-parallel-size 4 \\
  --block-size 128 \\
  --language-model-only \\
  --moe-backend aiter \\
  --kv-cache-dtype fp8 \\
  --max-num-batched-tokens 32768 \\
  --attention-backend TRITON_ATTN \\
  --linear-backend emulation \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi355x", "variant": "mxfp8", "tensor_parallel_size": 4, "high_concurrency": True},
        modalities=TEXT),
    # ---- NVFP4 on Blackwell: the tested B200 baseline
    *[Row(f"nvfp4-tp8-{hw}", """
VLLM_FLOAT32_MATMUL_PRECISION=high \\
  vllm serve nvidia/MiniMax-M3-NVFP4 \\
  --tensor-parallel-size 8 \\
  --trust-remote-code \\
  --block-size 128 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": hw, "variant": "nvfp4"}, image="vllm/vllm-openai:minimax-m3") for hw in ("b200", "b300")],
    # ---- NVFP4 + EAGLE3 (MHA draft), text only
    Row("nvfp4-eagle3-mha", """
VLLM_FLOAT32_MATMUL_PRECISION=high \\
  vllm serve nvidia/MiniMax-M3-NVFP4 \\
  --tensor-parallel-size 8 \\
  --trust-remote-code \\
  --block-size 128 \\
  --language-model-only \\
  --speculative-config '{"method": "eagle3", "model": "Inferact/MiniMax-M3-EAGLE3", "num_speculative_tokens": 3, "attention_backend": "FLASH_ATTN"}'
""", {"hardware": "b200", "variant": "nvfp4", "speculative_decoding": True}, modalities=TEXT),
    # ---- NVFP4 + EAGLE3 (GQA draft) for long context / high batch
    Row("nvfp4-eagle3-gqa", """
VLLM_FLOAT32_MATMUL_PRECISION=high \\
  vllm serve nvidia/MiniMax-M3-NVFP4 \\
  --tensor-parallel-size 8 \\
  --trust-remote-code \\
  --block-size 128 \\
  --language-model-only \\
  --speculative-config '{"method": "eagle3", "model": "Inferact/MiniMax-M3-EAGLE3-GQA", "num_speculative_tokens": 3, "attention_backend": "FLASH_ATTN"}'
""", {"hardware": "b200", "variant": "nvfp4", "speculative_decoding": True, "draft_head": "gqa"}, modalities=TEXT),
    # ---- ... with FlashInfer draft attention and local argmax reduction (the recipe's flag, on the GQA command)
    Row("nvfp4-eagle3-gqa-flashinfer", """
VLLM_FLOAT32_MATMUL_PRECISION=high \\
  vllm serve nvidia/MiniMax-M3-NVFP4 \\
  --tensor-parallel-size 8 \\
  --trust-remote-code \\
  --block-size 128 \\
  --language-model-only \\
  --speculative-config '{"method":"eagle3","model":"Inferact/MiniMax-M3-EAGLE3-GQA","num_speculative_tokens":3,"attention_backend":"FLASHINFER","use_local_argmax_reduction":true}'
""", {"hardware": "b200", "variant": "nvfp4", "speculative_decoding": True, "draft_head": "gqa",
      "draft_attention_backend": "FLASHINFER", "draft_local_argmax_reduction": True}, modalities=TEXT),
    # ---- MXFP4 on MI355X: the tested TP8 baseline
    Row("mxfp4-mi355x", AMD_PREAMBLE + """
vllm serve amd/MiniMax-M3-MXFP4 \\
  --tensor-parallel-size 8 \\
  --trust-remote-code \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend ROCM_AITER_FA \\
  --tool-call-parser minimax_m3 \\
  --enable-auto-tool-choice \\
  --reasoning-parser minimax_m3
""", {"hardware": "mi355x", "variant": "mxfp4"}, image="vllm/vllm-openai-rocm:nightly"),
    # ---- Troubleshooting, Vision encoder: Encoder Parallel on NVIDIA (FlashInfer) and AMD (AITER FA), with the
    # host-shared-memory multimodal processor cache
    Row("encoder-parallel-nvidia", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend FLASHINFER \\
  --mm-processor-cache-type shm \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "h200", "encoder_parallel": True}),
    Row("encoder-parallel-amd", AMD_PREAMBLE + """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --attention-backend TRITON_ATTN \\
  --mm-encoder-tp-mode data \\
  --mm-encoder-attn-backend ROCM_AITER_FA \\
  --mm-processor-cache-type shm \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "mi355x", "encoder_parallel": True}),
    # ---- Troubleshooting, Text only on NVIDIA
    Row("text-only-nvidia", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --language-model-only \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "h200"}, modalities=TEXT),
    # ---- The deployment guide's eight-GPU BF16 baseline with a 128K ceiling
    Row("guide-h200-bf16-128k", """
vllm serve MiniMaxAI/MiniMax-M3 \\
  --tensor-parallel-size 8 \\
  --block-size 128 \\
  --max-model-len 131072 \\
  --tool-call-parser minimax_m3 \\
  --reasoning-parser minimax_m3 \\
  --enable-auto-tool-choice
""", {"hardware": "h200"}, max_model_len=131072),
]


def _pool(row: Row) -> PoolConfig:
    return PoolConfig.model_validate(
        {"name": "p", "max_model_len": row.max_model_len, "modalities": row.modalities, "launch": row.launch}
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_rendered_command_is_the_recipe_plus_gateway_flags(row: Row) -> None:
    want_env, want_model, want_flags = parse_recipe(row.recipe, row.max_model_len)
    (cmd,) = render(_pool(row), SERVED)

    assert cmd.argv[:2] == ["vllm", "serve"]
    assert cmd.argv[2] == want_model
    got_flags = parse_flags(cmd.argv[3:])
    for flag, value in want_flags.items():
        assert got_flags.get(flag) == value, f"{flag}: recipe {value!r}, rendered {got_flags.get(flag)!r}"
    added = gateway_additions(row.max_model_len, want_model)
    extra = {flag: value for flag, value in got_flags.items() if flag not in want_flags}
    unexpected = {flag: value for flag, value in extra.items() if added.get(flag) != value}
    assert not unexpected, f"flags neither in the recipe nor added by the gateway: {unexpected}"
    assert ("--served-model-name" in got_flags) == (want_model != SERVED)
    assert cmd.env == want_env
    if row.image is not None:
        assert cmd.image == row.image


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_shell_form_round_trips_to_argv_and_env(row: Row) -> None:
    (cmd,) = render(_pool(row), SERVED)
    tokens = shlex.split(cmd.shell.replace("\\\n", " "))
    env = dict(t.split("=", 1) for t in tokens[: len(cmd.env)])
    assert env == cmd.env
    assert tokens[len(cmd.env):] == cmd.argv


def test_one_command_per_replica_all_identical_but_for_their_index() -> None:
    pool = PoolConfig.model_validate(
        {"name": "short", "max_model_len": 32768, "launch": {"hardware": "h200", "variant": "mxfp8",
                                                              "tensor_parallel_size": 4, "replicas": 3}}
    )
    cmds = render(pool, SERVED)
    assert [c.replica for c in cmds] == [0, 1, 2]
    assert [c.name for c in cmds] == ["short-0", "short-1", "short-2"]
    assert all(c.argv == cmds[0].argv and c.env == cmds[0].env for c in cmds)
    assert all(c.gpus == 4 and c.gpu_resource == "nvidia.com/gpu" for c in cmds)


def test_precise_prefix_routing_adds_kv_events_and_a_cross_language_hash() -> None:
    pool = PoolConfig.model_validate(
        {"name": "short", "max_model_len": 32768, "launch": {"hardware": "h200", "kv_events": True}}
    )
    (cmd,) = render(pool, SERVED)
    flags = parse_flags(cmd.argv[3:])
    # vllm-contract.md §6: "Use the `*` form", hash "sha256_cbor: SHA-256 of canonical CBOR, which is cross-language".
    assert flags["--prefix-caching-hash-algo"] == "sha256_cbor"
    events = flags["--kv-events-config"]
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert (events["endpoint"], events["replay_endpoint"], events["topic"]) == ("tcp://*:5557", "tcp://*:5558", "kv")
    assert flags["--enable-prefix-caching"] is True
    assert cmd.kv_events_ports == (5557,)


def test_kv_events_with_data_parallel_keep_replay_clear_of_every_rank() -> None:
    pool = PoolConfig.model_validate({"name": "p", "max_model_len": 32768, "launch": {
        "hardware": "h200", "tensor_parallel_size": 1, "data_parallel_size": 8, "expert_parallel": True,
        "kv_events": True}})
    (cmd,) = render(pool, SERVED)
    events = parse_flags(cmd.argv[3:])["--kv-events-config"]
    replay = int(events["replay_endpoint"].rsplit(":", 1)[1])
    assert cmd.kv_events_ports == tuple(range(5557, 5565))  # "DP rank r uses port +r"
    assert replay not in cmd.kv_events_ports and replay + 7 not in cmd.kv_events_ports


def test_tracing_flags_and_service_name() -> None:
    pool = PoolConfig.model_validate({"name": "long", "max_model_len": 262144, "launch": {
        "hardware": "h200", "otlp_traces_endpoint": "http://otel-collector:4317", "collect_detailed_traces": "model"}})
    (cmd,) = render(pool, SERVED)
    flags = parse_flags(cmd.argv[3:])
    assert flags["--otlp-traces-endpoint"] == "http://otel-collector:4317"
    assert flags["--collect-detailed-traces"] == "model"
    assert cmd.env["OTEL_SERVICE_NAME"] == "vllm-long"
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in cmd.env  # a collector's gRPC port: vLLM's default


@pytest.mark.parametrize(("launch", "protocol"), [
    ({"otlp_traces_endpoint": "http://m3gate:8080/v1/traces"}, "http/protobuf"),  # the gateway's receiver
    ({"otlp_traces_endpoint": "http://otel:4318/v1/traces/"}, "http/protobuf"),
    ({"otlp_traces_endpoint": "http://otel:4318/custom", "otlp_traces_protocol": "http/protobuf"}, "http/protobuf"),
    ({"otlp_traces_endpoint": "http://m3gate:8080/v1/traces", "otlp_traces_protocol": "grpc"}, "grpc"),
])
def test_engine_spans_to_the_gateway_are_exported_over_http(launch: dict[str, str], protocol: str) -> None:
    pool = PoolConfig.model_validate({"name": "p", "max_model_len": 32768, "launch": {"hardware": "h200", **launch}})
    (cmd,) = render(pool, SERVED)
    assert parse_flags(cmd.argv[3:])["--otlp-traces-endpoint"] == launch["otlp_traces_endpoint"]
    assert cmd.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == protocol


def test_a_traces_protocol_needs_an_endpoint() -> None:
    with pytest.raises(ValueError, match="otlp_traces_protocol needs otlp_traces_endpoint"):
        PoolConfig.model_validate({"name": "p", "max_model_len": 32768, "launch": {
            "hardware": "h200", "otlp_traces_protocol": "http/protobuf"}})


def test_render_config_uses_the_gateway_model_as_served_name() -> None:
    cfg = GatewayConfig.model_validate({"model": "minimax-m3", "pools": [
        {"name": "a", "max_model_len": 32768, "launch": {"hardware": "h200"}},
        {"name": "b", "max_model_len": 65536},
    ]})
    from policies.launch import render_config

    cmds = render_config(cfg)
    assert [c.pool for c in cmds] == ["a"]  # pools without a launch section are launched elsewhere
    assert parse_flags(cmds[0].argv[3:])["--served-model-name"] == "minimax-m3"


def test_priority_scheduling_pool_launches_its_replicas_with_priority_policy() -> None:
    base = {"name": "p", "max_model_len": 32768, "launch": {"hardware": "h200"}}
    fcfs = parse_flags(render(PoolConfig.model_validate(base), SERVED)[0].argv[3:])
    prio = parse_flags(render(PoolConfig.model_validate({**base, "scheduling_policy": "priority"}), SERVED)[0].argv[3:])
    assert "--scheduling-policy" not in fcfs  # vLLM's default is fcfs
    assert prio["--scheduling-policy"] == "priority"
