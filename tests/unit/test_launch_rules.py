"""Each rule of `policies.launch` against the line of the vLLM MiniMax-M3 recipe it implements (quoted verbatim from
shared/seeds/minimax-m3-vllm-recipe.md or the low-latency deployment guide beside it): the (args, env) fragment a
rule returns must be exactly what the quoted lines say, and nothing when the rule does not apply. The rules that
serve the gateway rather than the recipe say why instead. Refusals are lists of reasons, in the recipe's order."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import pytest

from policies import launch
from policies.config import PoolConfig
from policies.launch import Fragment, ReplicaLaunch

MULTIMODAL = ["text", "image", "video"]
NOTHING: Fragment = ([], {})


def quoted(*lines: str) -> Fragment:
    """The (args, env) the recipe lines say: `export K=V` and `K=V \\` are environment (a `${K:-default}` reads as its
    default), everything else is command-line tokens, in order; shell comments are dropped."""
    args: list[str] = []
    env: dict[str, str] = {}
    for line in lines:
        tokens = shlex.split(line.rstrip().removesuffix("\\"), comments=True)
        if tokens and tokens[0] == "export":
            tokens = tokens[1:]
        if tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
            key, value = tokens[0].split("=", 1)
            env[key] = re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", value)
        else:
            args += tokens
    return args, env


def replica(launch_spec: dict[str, Any], *, served_model: str | None = None, **pool: Any) -> ReplicaLaunch:
    cfg = PoolConfig.model_validate({"name": "p", "max_model_len": 131072, "modalities": MULTIMODAL,
                                     "launch": launch_spec, **pool})
    assert cfg.launch is not None
    return ReplicaLaunch(cfg.launch, cfg, served_model)


def test_serve_names_the_checkpoint_and_its_parallelism() -> None:
    # "vllm serve MiniMaxAI/MiniMax-M3 \" / "--tensor-parallel-size 8 \" / "--enable-expert-parallel \"
    assert launch.serve(replica({"hardware": "h200", "expert_parallel": True})) == quoted(
        "vllm serve MiniMaxAI/MiniMax-M3 \\", "  --tensor-parallel-size 8 \\", "  --enable-expert-parallel \\")
    # "DP8 + Expert Parallel": "--data-parallel-size 8 \"
    assert launch.serve(replica({"hardware": "h200", "tensor_parallel_size": 1, "data_parallel_size": 8})) == quoted(
        "vllm serve MiniMaxAI/MiniMax-M3 \\", "  --data-parallel-size 8 \\")
    # "vllm serve MiniMaxAI/MiniMax-M3-MXFP8 \" with "--tensor-parallel-size 4 \"
    assert launch.serve(replica({"hardware": "mi355x", "variant": "mxfp8", "tensor_parallel_size": 4})) == quoted(
        "vllm serve MiniMaxAI/MiniMax-M3-MXFP8 \\", "  --tensor-parallel-size 4 \\")


def test_remote_code_for_the_nvfp4_and_mxfp4_checkpoints() -> None:
    # "vllm serve nvidia/MiniMax-M3-NVFP4 \" ... "--trust-remote-code \"; "vllm serve amd/MiniMax-M3-MXFP4 \" likewise
    assert launch.remote_code(replica({"hardware": "b200", "variant": "nvfp4"})) == quoted("  --trust-remote-code \\")
    assert launch.remote_code(replica({"hardware": "mi355x", "variant": "mxfp4"})) == quoted("  --trust-remote-code \\")
    assert launch.remote_code(replica({"hardware": "h200"})) == NOTHING


def test_block_size_is_128_and_the_length_is_the_pools() -> None:
    # "**`--block-size 128` is mandatory on every platform** (MSA sparse/index cache)."
    # "--max-model-len 131072        # 128K instead of the full 1M"
    assert launch.block_and_length(replica({"hardware": "h200"})) == quoted(
        "  --block-size 128 \\", "  --max-model-len 131072        # 128K instead of the full 1M")


def test_language_model_only_exactly_when_the_pool_takes_only_text() -> None:
    # "For **text-only** workloads enable *Text only* (`--language-model-only`) to skip loading the encoder"
    assert launch.language_model_only(replica({"hardware": "h200"}, modalities=["text"])) == quoted(
        "  --language-model-only \\")
    assert launch.language_model_only(replica({"hardware": "h200"})) == NOTHING
    assert launch.language_model_only(replica({"hardware": "h200", "text_only": False}, modalities=["text"])) == NOTHING


def test_nvfp4_runs_float32_matmuls_at_high_precision() -> None:
    # "VLLM_FLOAT32_MATMUL_PRECISION=high \" before "vllm serve nvidia/MiniMax-M3-NVFP4 \"
    assert launch.nvfp4_precision(replica({"hardware": "b200", "variant": "nvfp4"})) == quoted(
        "VLLM_FLOAT32_MATMUL_PRECISION=high \\")
    assert launch.nvfp4_precision(replica({"hardware": "b200", "variant": "mxfp8"})) == NOTHING


def test_every_amd_command_avoids_the_breakable_cudagraph_and_uses_triton_attention() -> None:
    # "On AMD MI300X / MI325X / MI355X, run with CUDA graphs and set the following before any of the serve commands
    # below.": "export VLLM_USE_BREAKABLE_CUDAGRAPH=0"; each AMD command has "--attention-backend TRITON_ATTN \"
    expected = quoted("  --attention-backend TRITON_ATTN \\", "export VLLM_USE_BREAKABLE_CUDAGRAPH=0")
    for hardware in ("mi300x", "mi325x", "mi355x"):
        assert launch.amd_baseline(replica({"hardware": hardware})) == expected
    assert launch.amd_baseline(replica({"hardware": "h200"})) == NOTHING


def test_online_fp8_per_channel_on_the_amd_bf16_checkpoint() -> None:
    # "##### TP8 + `--quantization fp8_per_channel`": "export VLLM_ROCM_USE_AITER=1", "export VLLM_ROCM_USE_AITER_MOE=0"
    assert launch.online_fp8(replica({"hardware": "mi300x", "online_quantization": "fp8_per_channel"})) == quoted(
        "  --quantization fp8_per_channel \\", "export VLLM_ROCM_USE_AITER=1", "export VLLM_ROCM_USE_AITER_MOE=0")
    assert launch.online_fp8(replica({"hardware": "mi300x"})) == NOTHING


def test_mxfp8_on_mi300x_stacks_the_inferencex_levers() -> None:
    # "On AMD MI300X, the **mxfp8** variant stacks two accuracy-safe scheduling levers from the InferenceX MI300X
    # tuning recipe and avoids the high-concurrency expert-parallel regression by using plain TP8:"
    assert launch.mi300x_mxfp8(replica({"hardware": "mi300x", "variant": "mxfp8"})) == quoted(
        "export VLLM_ENGINE_READY_TIMEOUT_S=3600",
        "export VLLM_ROCM_USE_AITER=1",
        "export VLLM_ROCM_USE_AITER_MHA=0",
        "export TORCH_BLAS_PREFER_HIPBLASLT=1",
        'export NCCL_MIN_NCHANNELS="${NCCL_MIN_NCHANNELS:-112}"',
        'export GPU_MAX_HW_QUEUES="${GPU_MAX_HW_QUEUES:-2}"',
        "  --async-scheduling \\",
        "  --max-num-batched-tokens 16384 \\",
    )
    assert launch.mi300x_mxfp8(replica({"hardware": "mi355x", "variant": "mxfp8"})) == NOTHING


def test_mxfp8_on_mi355x_enables_aiter_fused_shared_experts_and_int4_quickreduce() -> None:
    # "On AMD MI355X the **mxfp8** variant additionally enables the AITER kernels, the fused shared-experts MoE, and
    # INT4 QuickReduce"
    assert launch.mi355x_mxfp8(replica({"hardware": "mi355x", "variant": "mxfp8"})) == quoted(
        "export VLLM_ROCM_USE_AITER=1",
        "export VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1",
        "export VLLM_ROCM_QUICK_REDUCE_QUANTIZATION=INT4",
    )
    assert launch.mi355x_mxfp8(replica({"hardware": "mi300x", "variant": "mxfp8"})) == NOTHING


def test_high_concurrency_is_the_aiter_page16_configuration() -> None:
    # "#### MXFP8 high-concurrency options on MI355X" ... "The high-concurrency configuration is:"
    spec = {"hardware": "mi355x", "variant": "mxfp8", "tensor_parallel_size": 4, "high_concurrency": True}
    assert launch.high_concurrency(replica(spec)) == quoted(
        "export VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1",
        "export VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16=0",
        "export VLLM_ROCM_QUICK_REDUCE_QUANTIZATION_MIN_SIZE_KB=256",
        "  --moe-backend aiter \\",
        "  --max-num-batched-tokens 32768 \\",
        "  --linear-backend emulation \\",
    )
    assert launch.high_concurrency(replica({**spec, "high_concurrency": False})) == NOTHING


def test_fp8_kv_past_the_native_context_and_with_high_concurrency() -> None:
    # "TP=8 + fp8 KV is the practical combo at 1M:" ... "--kv-cache-dtype fp8 \"
    fp8 = quoted("  --kv-cache-dtype fp8 \\")
    assert launch.kv_cache_dtype(replica({"hardware": "h200"}, max_model_len=1048576)) == fp8
    assert launch.kv_cache_dtype(replica({"hardware": "mi355x", "variant": "mxfp8", "tensor_parallel_size": 4,
                                          "high_concurrency": True})) == fp8
    # "Add `--kv-cache-dtype fp8` to any command for ~1.5× the KV pool"
    assert launch.kv_cache_dtype(replica({"hardware": "h200", "kv_cache_dtype": "fp8"})) == fp8
    assert launch.kv_cache_dtype(replica({"hardware": "h200"})) == NOTHING
    assert launch.kv_cache_dtype(replica({"hardware": "h200", "kv_cache_dtype": "auto"}, max_model_len=1048576)) \
        == NOTHING


def test_amd_past_512k_needs_yarn_on_the_text_config() -> None:
    # "AMD ROCm notes: Native context is 512K. To go past it, supply a YaRN rope_scaling on the text config"
    args, env = launch.amd_long_context(replica({"hardware": "mi355x"}, max_model_len=1048576))
    expected_args, expected_env = quoted(
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 \\",
        "  --hf-overrides '{\"text_config\":{\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2.0,"
        "\"original_max_position_embeddings\":524288}}}'",
    )
    assert env == expected_env
    assert args[0] == expected_args[0] and json.loads(args[1]) == json.loads(expected_args[1])
    assert launch.amd_long_context(replica({"hardware": "mi355x"}, max_model_len=524288)) == NOTHING
    assert launch.amd_long_context(replica({"hardware": "h200"}, max_model_len=1048576)) == NOTHING


def test_encoder_parallel_flags() -> None:
    # AMD multimodal commands: "--mm-encoder-tp-mode data \" / "--mm-encoder-attn-backend ROCM_AITER_FA \"
    assert launch.encoder_parallel(replica({"hardware": "mi355x"})) == quoted(
        "  --mm-encoder-tp-mode data \\", "  --mm-encoder-attn-backend ROCM_AITER_FA \\")
    # "the *Encoder Parallel* option runs it data-parallel (`--mm-encoder-tp-mode data`) ... (FlashInfer on NVIDIA,
    # `--mm-encoder-attn-backend FLASHINFER`; ...) and the host-shared-memory multimodal processor cache
    # (`--mm-processor-cache-type shm`)"
    assert launch.encoder_parallel(replica({"hardware": "h200", "encoder_parallel": True})) == quoted(
        "--mm-encoder-tp-mode data", "--mm-encoder-attn-backend FLASHINFER", "--mm-processor-cache-type shm")
    assert launch.encoder_parallel(replica({"hardware": "h200"})) == NOTHING
    assert launch.encoder_parallel(replica({"hardware": "mi355x"}, modalities=["text"])) == NOTHING


def test_speculative_decoding_is_eagle3_with_three_tokens() -> None:
    # the recipe's NVFP4 + EAGLE3 command, character for character
    assert launch.speculative(replica({"hardware": "b200", "variant": "nvfp4", "speculative_decoding": True})) == \
        quoted("  --speculative-config '{\"method\": \"eagle3\", \"model\": \"Inferact/MiniMax-M3-EAGLE3\", "
               "\"num_speculative_tokens\": 3, \"attention_backend\": \"FLASH_ATTN\"}'")
    # "You may also consider FlashInfer for draft attention ... and local argmax reduction"
    args, env = launch.speculative(replica({"hardware": "b200", "variant": "nvfp4", "speculative_decoding": True,
                                            "draft_head": "gqa", "draft_attention_backend": "FLASHINFER",
                                            "draft_local_argmax_reduction": True}))
    expected = quoted("--speculative-config '{\"method\":\"eagle3\",\"model\":\"Inferact/MiniMax-M3-EAGLE3-GQA\","
                      "\"num_speculative_tokens\":3,\"attention_backend\":\"FLASHINFER\","
                      "\"use_local_argmax_reduction\":true}'")
    assert env == {} and args[0] == expected[0][0] and json.loads(args[1]) == json.loads(expected[0][1])
    assert launch.speculative(replica({"hardware": "b200"})) == NOTHING


def test_both_parsers_are_minimax_m3() -> None:
    # "**Parsers.** `--tool-call-parser` and `--reasoning-parser` both use `minimax_m3`"
    assert launch.parsers(replica({"hardware": "h200"})) == quoted(
        "  --tool-call-parser minimax_m3 \\", "  --reasoning-parser minimax_m3 \\", "  --enable-auto-tool-choice")


def test_served_model_name_only_when_the_gateway_serves_another_id() -> None:
    # The gateway's: replicas answer to the model id clients send through it.
    assert launch.served_model_name(replica({"hardware": "h200"}, served_model="m3")) == (
        ["--served-model-name", "m3"], {})
    assert launch.served_model_name(replica({"hardware": "h200"}, served_model="MiniMaxAI/MiniMax-M3")) == NOTHING
    assert launch.served_model_name(replica({"hardware": "h200"})) == NOTHING


def test_the_gateway_observes_prefix_caching_cached_tokens_and_load() -> None:
    # guide: "Use prefix caching when requests share stable system prompts, repositories, or tool schemas."
    assert launch.gateway_observes(replica({"hardware": "h200", "port": 8001})) == (
        ["--port", "8001", "--enable-prefix-caching", "--enable-prompt-tokens-details",
         "--enable-server-load-tracking"], {})


def test_priority_scheduling_follows_the_pool() -> None:
    # The gateway's: with `scheduling_policy: priority` it sends each request's class priority in the body.
    assert launch.scheduling_policy(replica({"hardware": "h200"}, scheduling_policy="priority")) == (
        ["--scheduling-policy", "priority"], {})
    assert launch.scheduling_policy(replica({"hardware": "h200"})) == NOTHING


def test_kv_events_publish_with_a_hash_the_gateway_reproduces() -> None:
    # The gateway's precise prefix routing: events on the PUB port, replay past every DP rank's port, sha256_cbor.
    args, env = launch.kv_events(replica({"hardware": "h200", "kv_events": True, "data_parallel_size": 2,
                                          "tensor_parallel_size": 4}))
    assert env == {} and args[:3] == ["--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config"]
    assert json.loads(args[3]) == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                                   "replay_endpoint": "tcp://*:5559", "topic": "kv"}
    assert launch.kv_events(replica({"hardware": "h200"})) == NOTHING


@pytest.mark.parametrize(("endpoint", "protocol"), [("http://gw:8080/v1/traces", "http/protobuf"),
                                                    ("http://otel:4317", None)])
def test_tracing_names_the_pool_and_speaks_http_to_a_traces_receiver(endpoint: str, protocol: str | None) -> None:
    # The gateway's: engine spans joined to its own traces (`telemetry.tracing.receive_engine_spans`).
    args, env = launch.tracing(replica({"hardware": "h200", "otlp_traces_endpoint": endpoint,
                                        "collect_detailed_traces": "all"}))
    assert args == ["--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"]
    assert env == {"OTEL_SERVICE_NAME": "vllm-p", **({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
                                                     if protocol else {})}
    assert launch.tracing(replica({"hardware": "h200"})) == NOTHING


def test_sigterm_lets_the_streams_in_flight_finish_for_the_shutdown_timeout() -> None:
    # The gateway's: vLLM's default (0) aborts every stream in flight on SIGTERM; with N it refuses new requests
    # (which the gateway sends elsewhere) and lets those in flight run up to N seconds. Every replica carries it.
    assert launch.graceful_shutdown(replica({"hardware": "h200"})) == (["--shutdown-timeout", "60"], {})
    assert launch.graceful_shutdown(replica({"hardware": "h200", "shutdown_timeout_s": 0})) == (
        ["--shutdown-timeout", "0"], {})
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        replica({"hardware": "h200", "shutdown_timeout_s": -1})
    with pytest.raises(ValueError, match="--shutdown-timeout"):
        replica({"hardware": "h200", "extra_args": ["--shutdown-timeout", "5"]})  # the renderer owns the flag
    pd = PoolConfig.model_validate({
        "name": "pd", "max_model_len": 131072, "modalities": ["text"], "launch": {"hardware": "h200"},
        "disaggregation": {"prefill": {"endpoints": ["http://p:8000"]}, "decode": {"endpoints": ["http://d:8000"]}}})
    for cmd in launch.render(pd, "m3"):
        i = cmd.argv.index("--shutdown-timeout")
        assert cmd.argv[i + 1] == "60", cmd.role


def test_extra_args_come_last_as_given() -> None:
    assert launch.extra_args(replica({"hardware": "h200", "extra_args": ["--seed", "1"]})) == (["--seed", "1"], {})


def test_every_rule_is_applied_once_in_order() -> None:
    assert len(set(launch.RULES)) == len(launch.RULES) == 22
    spec = replica({"hardware": "mi355x", "variant": "mxfp8", "tensor_parallel_size": 4, "high_concurrency": True,
                    "kv_events": True}, served_model="m3")
    argv = [a for rule in launch.RULES for a in rule(spec)[0]]
    rendered = launch.render(spec.pool, "m3")[0]
    assert rendered.argv == argv


def test_pool_refusals_list_every_reason_in_the_recipes_order() -> None:
    spec = launch.LaunchSpec(hardware="h200", text_only=True, extra_env={"OTEL_SERVICE_NAME": "x"},
                             otlp_traces_endpoint="http://otel:4317")
    pool = PoolConfig.model_validate({"name": "p", "max_model_len": 131072})
    wide = pool.model_copy(update={"block_size": 64, "max_model_len": 2_000_000, "modalities": MULTIMODAL})
    reasons = launch.pool_refusals(spec, wide)
    assert [r.split(":")[0] for r in reasons] == [
        "pool block_size 64", "max_model_len 2000000 exceeds MiniMax-M3's full window (context_length",
        "text_only on a pool accepting text, image, video", "extra_env overrides OTEL_SERVICE_NAME, which the recipe "
        "sets for h200/bf16"]
    with pytest.raises(launch.LaunchError, match="block_size 64"):
        spec.check_pool(wide)


def test_extra_env_may_set_what_the_recipe_leaves_alone() -> None:
    spec = launch.LaunchSpec(hardware="h200", extra_env={"VLLM_ROCM_USE_AITER": "1"})
    pool = PoolConfig.model_validate({"name": "p", "max_model_len": 131072})
    assert launch.pool_refusals(spec, pool) == []
    amd = launch.LaunchSpec(hardware="mi355x", variant="mxfp8", tensor_parallel_size=4,
                            extra_env={"VLLM_ROCM_USE_AITER": "1"})
    assert launch.pool_refusals(amd, pool) == [
        "extra_env overrides VLLM_ROCM_USE_AITER, which the recipe sets for mi355x/mxfp8"]


def test_incompatibilities_list_every_reason() -> None:
    spec = launch.LaunchSpec.model_construct(
        hardware="h200", variant="nvfp4", tensor_parallel_size=16, data_parallel_size=1, text_only=True,
        encoder_parallel=True, online_quantization=None, high_concurrency=False, speculative_decoding=False,
        collect_detailed_traces=None, otlp_traces_endpoint=None, otlp_traces_protocol=None, kv_events=False,
        kv_events_port=5557, port=8000, extra_args=(), extra_env={})
    assert [r.split(":")[0] for r in launch.incompatibilities(spec)] == [
        "variant nvfp4 on h200", "16 GPUs per replica on h200 spans nodes (8 per node)",
        "text_only with encoder_parallel"]
