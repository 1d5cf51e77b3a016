"""`m3gate sim` options. Names follow `vllm serve` where vLLM has the concept, so a replica's command line reads the
same; a few vLLM flags are accepted and ignored so rendered `vllm serve` commands can be pointed at the simulator."""

from __future__ import annotations

import argparse
import os
import sys

from pools.sim.faults import FaultSettings
from pools.sim.settings import CostModel, KVTransferSettings, SimSettings


def _modalities(text: str) -> tuple[str, ...]:
    items = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = set(items) - {"text", "image", "video", "audio"}
    if unknown or "text" not in items:
        raise argparse.ArgumentTypeError("a comma list of text,image,video,audio that includes text")
    return items


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8001,
                   help="listen port; 0 picks a free one (the chosen URL is printed on stdout) (default 8001)")
    g.add_argument("--model", default="MiniMaxAI/MiniMax-M3", help="model path/HF id, the card's `root` "
                   "(default MiniMaxAI/MiniMax-M3)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may send as `model` (default: the --model value)")
    g.add_argument("--max-model-len", type=int, default=32768, help="context length: prompt + output (default 32768)")
    g.add_argument("--shutdown-timeout", type=int, default=0, metavar="N",
                   help="on SIGTERM, abort new requests and let those in flight run up to N seconds before they are "
                        "failed and the server exits; 0 aborts them at once (vLLM's flag; default 0)")
    g.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 paths (default: env VLLM_API_KEY, else none)")

    g = parser.add_argument_group("engine model")
    g.add_argument("--max-num-seqs", type=int, default=256, help="largest running batch (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one step; long prefills are chunked to it (default 8192)")
    g.add_argument("--block-size", type=int, default=128, help="tokens per KV block (default 128, as M3 requires)")
    g.add_argument("--kv-blocks", type=int, default=32768,
                   help="KV-cache blocks (vLLM's num_gpu_blocks); must hold --max-model-len (default 32768)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached full blocks of equal prompt prefixes (default on)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV-cache events over ZMQ as vLLM does, e.g. '{\"enable_kv_cache_events\":true,"
                        "\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\","
                        "\"topic\":\"kv\"}' (tcp://*:0 picks a free port; GET /kv_event_sources says which)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export an llm_request span per request as vLLM does, over OTLP/HTTP (needs "
                   "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), e.g. http://gateway:8080/v1/traces")
    g.add_argument("--prefix-caching-hash-algo", default=None, choices=["sha256", "sha256_cbor"],
                   help="hash blocks as vLLM does (over token ids) so a gateway can reproduce them (default: a fast "
                        "internal hash)")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="reject with 503 when this many requests already wait (default: unlimited)")
    g.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="reject with 503 when waiting prompt tokens would exceed this (default: unlimited)")
    g.add_argument("--prefill-us-per-token", type=float, default=60.0,
                   help="prefill cost per uncached prompt token, microseconds (default 60)")
    g.add_argument("--decode-ms-per-step", type=float, default=12.0,
                   help="fixed cost of one engine step, milliseconds (default 12)")
    g.add_argument("--decode-ms-per-seq", type=float, default=0.05,
                   help="extra step cost per sequence in the batch, milliseconds (default 0.05)")
    g.add_argument("--speed", type=float, default=1.0, help="divide every modelled delay by this (default 1)")
    g.add_argument("--instant", action="store_true",
                   help="no modelled delays: each request is answered as fast as the process can (benchmarks)")

    g = parser.add_argument_group("prefill/decode disaggregation (vLLM's NixlConnector, pull mode)")
    g.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="both: no KV connector, kv_transfer_params are ignored (vLLM without --kv-transfer-config); "
                        "prefill / decode: the connector as kv_producer / kv_consumer. Either honours both kinds of "
                        "request, as NIXL does (default both)")
    g.add_argument("--engine-id", default=None,
                   help="the connector's engine id, sent as remote_engine_id (default: a new uuid4 per start, as "
                        "vLLM, so a decode replica notices a restarted prefill replica)")
    g.add_argument("--kv-transfer-ms-per-block", type=float, default=0.05,
                   help="decode side: time to pull one KV block from the prefill replica, milliseconds, divided by "
                        "--speed (default 0.05)")
    g.add_argument("--kv-lease-duration", type=float, default=30.0,
                   help="prefill side: seconds its KV blocks stay held for the decode side (vLLM's "
                        "kv_connector_extra_config.kv_lease_duration; decode heartbeats extend it) (default 30)")
    g.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail",
                   help="decode side, when the pull fails (prefill replica gone or restarted): fail the request "
                        "with a 500, or recompute the prompt locally (vLLM's kv_load_failure_policy) (default fail)")

    g = parser.add_argument_group("model behaviour")
    g.add_argument("--seed", type=int, default=0, help="seed of every deterministic choice (default 0)")
    g.add_argument("--modalities", type=_modalities, default=("text",),
                   help="accepted inputs, e.g. text,image,video; media sent to a text-only replica get vLLM's 400 "
                        "(default text)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with a Hugging Face tokenizer.json (+ tokenizer_config.json chat_template) for "
                        "exact counts (default: a built-in 4-bytes-per-token tokenizer)")
    g.add_argument("--mean-output-tokens", type=int, default=256,
                   help="mean natural answer length; an answer stops early (finish_reason stop) when shorter than "
                        "max_tokens; 0 = always max_tokens (default 256)")
    g.add_argument("--tool-call-probability", type=_share, default=0.5,
                   help="share of tool_choice=auto requests with tools that get a tool call (default 0.5)")
    g.add_argument("--adaptive-thinking-probability", type=_share, default=0.5,
                   help="share of requests without thinking_mode=enabled/disabled that reason (default 0.5)")
    g.add_argument("--image-tokens", type=int, default=256, help="prompt tokens per image (default 256)")
    g.add_argument("--video-tokens", type=int, default=2048, help="prompt tokens per video (default 2048)")

    g = parser.add_argument_group("fault injection (also at run time: POST /sim/faults)")
    g.add_argument("--fault-error-rate", type=_share, default=0.0,
                   help="share of generate requests answered with a 500 InternalServerError (default 0)")
    g.add_argument("--fault-added-latency-ms", type=float, default=0.0,
                   help="delay before each generate request is handled (default 0)")
    g.add_argument("--fault-hang", action="store_true", help="accept generate requests and never answer them")
    g.add_argument("--fault-drop-mid-stream", type=_share, default=0.0,
                   help="share of generate responses whose TCP connection is cut after a few chunks (default 0)")
    g.add_argument("--fault-refuse-connections", action="store_true",
                   help="stop listening once started (new connections get ECONNREFUSED)")
    g.add_argument("--fault-refuse-for-s", type=float, default=None,
                   help="with --fault-refuse-connections: listen again after this many seconds")
    g.add_argument("--fault-unhealthy", action="store_true", help="/health answers 503 (requests are still served)")

    g = parser.add_argument_group("vllm serve flags accepted and ignored (the simulator always behaves as if set)")
    for flag in ("--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--trust-remote-code"):
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS if flag == "--trust-remote-code" else
                       "accepted for compatibility")
    for flag in ("--reasoning-parser", "--tool-call-parser", "--tensor-parallel-size", "--gpu-memory-utilization"):
        g.add_argument(flag, default=None, help="accepted for compatibility")


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        model=args.model, served_model_names=tuple(args.served_model_name or ()), max_model_len=args.max_model_len,
        host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, kv_blocks=args.kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching, max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        cost=CostModel(prefill_us_per_token=args.prefill_us_per_token, decode_ms_per_step=args.decode_ms_per_step,
                       decode_ms_per_seq=args.decode_ms_per_seq, speed=args.speed, instant=args.instant),
        seed=args.seed, modalities=args.modalities, tokenizer_dir=args.tokenizer,
        mean_output_tokens=args.mean_output_tokens, tool_call_probability=args.tool_call_probability,
        adaptive_thinking_probability=args.adaptive_thinking_probability, image_tokens=args.image_tokens,
        video_tokens=args.video_tokens, api_key=args.api_key, kv_events_config=args.kv_events_config,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo, hash_seed=os.environ.get("PYTHONHASHSEED"),
        otlp_traces_endpoint=args.otlp_traces_endpoint, shutdown_timeout=args.shutdown_timeout,
        kv_transfer=KVTransferSettings(role=args.role, engine_id=args.engine_id,
                                       ms_per_block=args.kv_transfer_ms_per_block,
                                       lease_duration_s=args.kv_lease_duration,
                                       load_failure_policy=args.kv_load_failure_policy,
                                       tp_size=_int_or(args.tensor_parallel_size, 1)),
        faults=FaultSettings(error_rate=args.fault_error_rate, added_latency_ms=args.fault_added_latency_ms,
                             hang=args.fault_hang, drop_mid_stream=args.fault_drop_mid_stream,
                             refuse_connections=args.fault_refuse_connections, refuse_for_s=args.fault_refuse_for_s,
                             unhealthy=args.fault_unhealthy))


def _int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def check_settings(s: SimSettings) -> str | None:
    """What vLLM would refuse to start with, as its message; None when the settings are usable."""
    if s.max_model_len <= 0 or s.block_size <= 0 or s.kv_blocks <= 0 or s.max_num_seqs <= 0:
        return "--max-model-len, --block-size, --kv-blocks and --max-num-seqs must be positive"
    if s.shutdown_timeout < 0:
        return "--shutdown-timeout must be >= 0"
    if s.cost.speed <= 0:
        return "--speed must be positive"
    if s.kv_blocks * s.block_size < s.max_model_len:
        return (f"To serve at least one request with the models's max seq len ({s.max_model_len}), "
                f"{-(-s.max_model_len // s.block_size)} KV blocks are needed, which is larger than the available KV "
                f"cache ({s.kv_blocks} blocks of {s.block_size} tokens). Try increasing --kv-blocks or decreasing "
                f"--max-model-len.")
    if s.max_num_batched_tokens < s.block_size:
        return "--max-num-batched-tokens must be at least --block-size"
    if s.kv_transfer.ms_per_block < 0 or s.kv_transfer.lease_duration_s <= 0:
        return "--kv-transfer-ms-per-block must be >= 0 and --kv-lease-duration positive"
    if s.kv_events_config is not None:
        from pools.sim.kv_events import parse_kv_events_config

        try:
            parse_kv_events_config(s.kv_events_config)
        except ValueError as exc:
            return f"--kv-events-config: {exc}"
    if s.otlp_traces_endpoint is not None:
        from pools.sim.tracing import check_protocol

        problem = check_protocol(os.environ)
        if problem:
            return problem
    return None


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    problem = check_settings(settings)
    if problem:
        print(f"m3gate sim: {problem}", file=sys.stderr)
        return 2
    from pools.sim.server import serve

    return serve(settings)
