"""Render the MiniMax-M3 recipe's `vllm serve` commands from a pool's `launch:` section.

The pools are started apart from the gateway, but from the same pool file, so a pool's `max_model_len`,
modalities and block size can never drift from what its replicas were launched with. The oracle for every
flag and environment variable is the vLLM MiniMax-M3 recipe (shared/seeds/minimax-m3-vllm-recipe.md); the
gateway only adds what it needs to observe and route (prefix caching details, load tracking, KV events,
tracing, a served model name). Combinations the recipe marks incompatible are refused with its own words,
when the config is loaded, so `m3gate config check` shows them with their line.

This module must not import policies.config (which imports it): pools are read through the `PoolLike` protocol.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

Hardware = Literal["h100", "h200", "b200", "b300", "gb200", "mi300x", "mi325x", "mi355x"]
Variant = Literal["bf16", "mxfp8", "nvfp4", "mxfp4"]

AMD: frozenset[str] = frozenset({"mi300x", "mi325x", "mi355x"})
BLACKWELL: frozenset[str] = frozenset({"b200", "b300", "gb200"})
GPUS_PER_NODE: Mapping[str, int] = {"gb200": 4}  # a GB200 compute tray holds 4 GPUs; the others are 8-GPU nodes
DEFAULT_GPUS_PER_NODE = 8

CHECKPOINTS: Mapping[str, str] = {
    "bf16": "MiniMaxAI/MiniMax-M3",
    "mxfp8": "MiniMaxAI/MiniMax-M3-MXFP8",
    "nvfp4": "nvidia/MiniMax-M3-NVFP4",
    "mxfp4": "amd/MiniMax-M3-MXFP4",
}
NVIDIA_IMAGE = "vllm/vllm-openai:minimax-m3"
ROCM_IMAGE = "vllm/vllm-openai-rocm:nightly"
EAGLE3_DRAFTS: Mapping[str, str] = {"mha": "Inferact/MiniMax-M3-EAGLE3", "gqa": "Inferact/MiniMax-M3-EAGLE3-GQA"}

BLOCK_SIZE = 128
NATIVE_CONTEXT = 524_288  # "Native context is 512K"
MAX_CONTEXT = 1_048_576  # "The full 1M-token window (context_length: 1048576)"
YARN_OVERRIDES = {
    "text_config": {
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE_CONTEXT}
    }
}

# Flags whose value the renderer owns: passing them through extra_args would silently fight the recipe.
OWNED_FLAGS: frozenset[str] = frozenset({
    "--tensor-parallel-size", "--data-parallel-size", "--enable-expert-parallel", "--trust-remote-code",
    "--block-size", "--max-model-len", "--language-model-only", "--quantization", "--kv-cache-dtype",
    "--attention-backend", "--mm-encoder-tp-mode", "--mm-encoder-attn-backend", "--mm-processor-cache-type",
    "--moe-backend", "--linear-backend", "--hf-overrides", "--speculative-config", "--tool-call-parser",
    "--reasoning-parser", "--enable-auto-tool-choice", "--served-model-name", "--port", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--prefix-caching-hash-algo", "--kv-events-config", "--enable-prompt-tokens-details",
    "--enable-server-load-tracking", "--otlp-traces-endpoint", "--collect-detailed-traces", "--api-key",
    "--scheduling-policy", "--kv-transfer-config",
})
# vLLM's NixlConnector: the role each side of a disaggregated pool is launched with, and NIXL's side channel (the
# decode replicas connect to the prefill replicas' VLLM_NIXL_SIDE_CHANNEL_HOST:PORT to read their blocks).
KV_CONNECTORS: Mapping[str, str] = {"nixl": "NixlConnector"}
KV_ROLES: Mapping[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
NIXL_SIDE_CHANNEL_PORT = 5600


class LaunchError(ValueError):
    """A launch spec the recipe rules out; a ValueError so pydantic reports it at the config's line."""


class LaunchSpec(BaseModel):
    """How one pool's replicas are started: the recipe's hardware, variant, strategy and features."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hardware: Hardware = Field(description="Accelerator of each replica's node.")
    variant: Variant = Field(default="bf16", description="Checkpoint: bf16, mxfp8, nvfp4 (Blackwell), mxfp4 (MI355X).")
    tensor_parallel_size: int = Field(default=8, ge=1, le=64)
    data_parallel_size: int = Field(default=1, ge=1, le=64)
    expert_parallel: bool = Field(default=False, description="--enable-expert-parallel (EP size = TP x DP).")
    replicas: int = Field(default=1, ge=1, le=1024, description="Independent vLLM servers in this pool.")
    kv_cache_dtype: Literal["auto", "fp8"] | None = Field(
        default=None,
        description="None: the recipe's choice (fp8 past the 512K native context and for MI355X high concurrency).",
    )
    speculative_decoding: bool = Field(default=False, description="EAGLE3 draft head, 3 speculative tokens.")
    draft_head: Literal["mha", "gqa"] = Field(
        default="mha", description="gqa: 16x smaller draft KV cache, for long context or large batches."
    )
    draft_attention_backend: Literal["FLASH_ATTN", "FLASHINFER"] | None = Field(
        default=None, description="Draft attention; None: FLASH_ATTN on NVIDIA (the recipe's), vLLM's choice on AMD."
    )
    draft_local_argmax_reduction: bool = Field(
        default=False, description="Local argmax reduction: less communication traffic (recipe's FlashInfer example)."
    )
    text_only: bool | None = Field(
        default=None, description="--language-model-only; None: true exactly when the pool accepts only text."
    )
    encoder_parallel: bool | None = Field(
        default=None,
        description="Vision encoder data-parallel. None: the recipe's default (AMD multimodal commands carry the "
        "encoder flags; NVIDIA ones do not).",
    )
    online_quantization: Literal["fp8_per_channel"] | None = Field(
        default=None, description="AMD, BF16 checkpoint only: online per-channel FP8 (PTPC)."
    )
    high_concurrency: bool = Field(
        default=False, description="MI355X MXFP8 only: AITER page-16 sparse paged attention (isl >= 8k, conc >= 64)."
    )
    kv_events: bool = Field(default=False, description="Publish KV cache events for precise prefix routing.")
    kv_events_port: int = Field(default=5557, ge=1, le=65000, description="ZMQ PUB port of DP rank 0.")
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM HTTP port.")
    image: str | None = Field(default=None, description="Container image; None: the recipe's image for the hardware.")
    otlp_traces_endpoint: str | None = Field(
        default=None, description="--otlp-traces-endpoint: a collector (http://otel:4317), or the gateway itself "
        "(http://<gateway>:8080/v1/traces, with telemetry.tracing.receive_engine_spans) for the engine stage split."
    )
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] | None = Field(
        default=None, description="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL for vLLM's exporter. None: http/protobuf when "
        "the endpoint's path ends in /v1/traces (the gateway's receiver speaks only that), else vLLM's grpc."
    )
    collect_detailed_traces: Literal["model", "worker", "all"] | None = None
    extra_args: tuple[str, ...] = Field(default=(), description="More vllm serve flags (not ones the renderer owns).")
    extra_env: dict[str, str] = Field(default_factory=dict, description="More environment (not the recipe's own).")

    @property
    def is_amd(self) -> bool:
        return self.hardware in AMD

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def checkpoint(self) -> str:
        return CHECKPOINTS[self.variant]

    @property
    def resolved_image(self) -> str:
        return self.image or (ROCM_IMAGE if self.is_amd else NVIDIA_IMAGE)

    @property
    def gpu_resource(self) -> str:
        """The Kubernetes extended resource name of one GPU of this hardware."""
        return "amd.com/gpu" if self.is_amd else "nvidia.com/gpu"

    @property
    def kv_events_ports(self) -> tuple[int, ...]:
        """PUB ports, one per DP rank: "DP rank r uses port +r"."""
        return tuple(self.kv_events_port + rank for rank in range(self.data_parallel_size))

    @property
    def kv_events_replay_port(self) -> int:
        # Rank r also offsets the replay port; start past the PUB range so no two ranks collide.
        return self.kv_events_port + self.data_parallel_size

    @model_validator(mode="after")
    def _recipe_allows(self) -> LaunchSpec:
        _refuse_incompatible(self)
        return self

    def check_pool(self, pool: PoolLike) -> None:
        """Raise LaunchError if this spec cannot serve `pool` (called by the pool config's validator)."""
        _build(self, pool, served_model=None)


class PoolLike(Protocol):
    """The parts of policies.config.PoolConfig that rendering reads."""

    @property
    def name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def modalities(self) -> Sequence[str]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def scheduling_policy(self) -> str: ...
    @property
    def launch(self) -> LaunchSpec | None: ...


class ConfigLike(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def pools(self) -> Sequence[PoolLike]: ...


@dataclass(frozen=True)
class ServeCommand:
    """One replica's launch: what to exec (argv), with which environment, in which image, on how many GPUs."""

    pool: str
    replica: int
    image: str
    gpus: int
    gpu_resource: str
    port: int
    argv: list[str]
    env: dict[str, str]
    kv_events_ports: tuple[int, ...] = field(default=())
    role: str = ""  # "prefill" | "decode" in a disaggregated pool

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.role}-{self.replica}" if self.role else f"{self.pool}-{self.replica}"

    @property
    def container_args(self) -> list[str]:
        """The arguments after `vllm serve`: the vLLM image's entrypoint is `vllm serve`."""
        return self.argv[2:]

    @property
    def shell(self) -> str:
        """A copy-pasteable, shell-quoted form, one flag per line like the recipe's commands."""
        lines = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        lines.append(" ".join(shlex.quote(a) for a in self.argv[:3]))
        args = self.argv[3:]
        i = 0
        while i < len(args):
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                lines.append(f"  {shlex.quote(args[i])} {shlex.quote(args[i + 1])}")
                i += 2
            else:
                lines.append(f"  {shlex.quote(args[i])}")
                i += 1
        return " \\\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "pool": self.pool, "replica": self.replica, "name": self.name, "image": self.image, "gpus": self.gpus,
            "gpu_resource": self.gpu_resource, "port": self.port, "argv": self.argv, "env": self.env,
            "kv_events_ports": list(self.kv_events_ports), "role": self.role or None, "shell": self.shell,
        }


def kv_transfer_config(role: str, connector: str, lease_s: float) -> dict[str, object]:
    """`--kv-transfer-config` of one side of a disaggregated pool (vLLM 0.32's NixlConnector, pull mode)."""
    return {"kv_connector": KV_CONNECTORS[connector], "kv_role": KV_ROLES[role],
            "kv_connector_extra_config": {"kv_lease_duration": int(lease_s) if lease_s == int(lease_s) else lease_s}}


def role_launches(pool: PoolLike) -> dict[str, LaunchSpec | None]:
    """A disaggregated pool's launch spec per role (the role's own `launch:`, else the pool's); {} otherwise."""
    d = getattr(pool, "disaggregation", None)
    if d is None:
        return {}
    return {role: getattr(d, role).launch or pool.launch for role in ("prefill", "decode")}


def renderable(pool: PoolLike) -> bool:
    roles = role_launches(pool)
    return all(roles.values()) if roles else pool.launch is not None


def render(pool: PoolLike, model: str) -> list[ServeCommand]:
    """The `vllm serve` command of each replica of `pool`, serving it under the gateway's model id `model`; for a
    disaggregated pool, its prefill replicas' then its decode replicas'."""
    roles = role_launches(pool)
    if roles:
        return [cmd for role, spec in roles.items() for cmd in _render_role(pool, model, role, spec)]
    spec = pool.launch
    if spec is None:
        raise LaunchError(f"pool {pool.name!r} has no `launch:` section to render")
    argv, env = _build(spec, pool, served_model=model)
    return [
        ServeCommand(
            pool=pool.name, replica=i, image=spec.resolved_image, gpus=spec.gpus_per_replica,
            gpu_resource=spec.gpu_resource, port=spec.port, argv=list(argv), env=dict(env),
            kv_events_ports=spec.kv_events_ports if spec.kv_events else (),
        )
        for i in range(spec.replicas)
    ]


def _render_role(pool: PoolLike, model: str, role: str, spec: LaunchSpec | None) -> list[ServeCommand]:
    if spec is None:
        raise LaunchError(f"pool {pool.name!r}: neither disaggregation.{role}.launch nor the pool's `launch:` "
                          f"says how to start its {role} replicas")
    d = getattr(pool, "disaggregation")
    argv, env = _build(spec, pool, served_model=model)
    argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(role, d.connector, d.kv_lease_s),
                                                separators=(",", ":"))]
    env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(NIXL_SIDE_CHANNEL_PORT))
    if "OTEL_SERVICE_NAME" in env and "OTEL_SERVICE_NAME" not in spec.extra_env:
        env["OTEL_SERVICE_NAME"] = f"vllm-{pool.name}-{role}"  # the two sides' spans apart in the trace
    return [
        ServeCommand(
            pool=pool.name, replica=i, image=spec.resolved_image, gpus=spec.gpus_per_replica,
            gpu_resource=spec.gpu_resource, port=spec.port, argv=list(argv), env=dict(env),
            kv_events_ports=spec.kv_events_ports if spec.kv_events else (), role=role,
        )
        for i in range(spec.replicas)
    ]


def render_config(config: ConfigLike, pool_name: str | None = None) -> list[ServeCommand]:
    """Every replica of every pool that has a launch section (or of the one named)."""
    pools = [p for p in config.pools if pool_name is None or p.name == pool_name]
    if pool_name is not None and not pools:
        raise LaunchError(f"no pool named {pool_name!r}; pools: {', '.join(p.name for p in config.pools)}")
    if pool_name is not None and not renderable(pools[0]):
        raise LaunchError(f"pool {pool_name!r} has no `launch:` section to render")
    return [cmd for p in pools if renderable(p) for cmd in render(p, config.model)]


def format_commands(commands: Sequence[ServeCommand], fmt: Literal["shell", "json"]) -> str:
    if fmt == "json":
        return json.dumps([c.to_json() for c in commands], indent=2) + "\n"
    blocks = []
    for c in commands:
        header = f"# pool {c.pool}, {c.role + ' ' if c.role else ''}replica {c.replica}: image {c.image}, {c.gpus} GPU(s) ({c.gpu_resource}), port {c.port}"
        if c.kv_events_ports:
            header += f", KV events on {', '.join(map(str, c.kv_events_ports))}"
        blocks.append(f"{header}\n{c.shell}\n")
    return "\n".join(blocks)


# ---------------------------------------------------------------------------------------------------------------
# The recipe, rule by rule


def _refuse_incompatible(spec: LaunchSpec) -> None:
    """Combinations the recipe rules out, checkable without the pool."""
    hw, variant, gpus = spec.hardware, spec.variant, spec.gpus_per_replica
    if variant == "nvfp4" and hw not in BLACKWELL:
        raise LaunchError(
            f"variant nvfp4 on {hw}: the NVFP4 checkpoint is for NVIDIA Blackwell only (recipe: \"Quantized Variant "
            "(NVFP4 on Blackwell)\"; B200, B300 or GB200)"
        )
    if variant == "mxfp4" and hw != "mi355x":
        raise LaunchError(
            f"variant mxfp4 on {hw}: the recipe says amd/MiniMax-M3-MXFP4 \"targets AMD Instinct MI355X (gfx950)\""
        )
    if spec.is_amd and variant == "bf16" and gpus < 8:
        raise LaunchError(f"bf16 on {hw} with {gpus} GPUs: the recipe says \"BF16 needs TP=8; the MXFP8 variant runs from TP=4.\"")
    if spec.is_amd and variant == "mxfp8" and gpus < 4:
        raise LaunchError(f"mxfp8 on {hw} with {gpus} GPUs: the recipe says \"the MXFP8 variant runs from TP=4.\"")
    per_node = GPUS_PER_NODE.get(hw, DEFAULT_GPUS_PER_NODE)
    if gpus > per_node:
        raise LaunchError(
            f"{gpus} GPUs per replica on {hw} spans nodes ({per_node} per node): multi-node strategies "
            "(recipe: \"multi-node strategies also need nodes=<n>\") are not rendered here"
        )
    if spec.text_only is True and spec.encoder_parallel is True:
        raise LaunchError(
            "text_only with encoder_parallel: the recipe says Text only (--language-model-only) \"is mutually "
            "exclusive with Encoder Parallel\""
        )
    if spec.online_quantization is not None and not (spec.is_amd and variant == "bf16"):
        raise LaunchError(
            f"online_quantization {spec.online_quantization} with {variant} on {hw}: the recipe's AMD "
            "--quantization fp8_per_channel recipe says \"These env vars and the flag are for the BF16 checkpoint only.\""
        )
    if spec.high_concurrency and not (hw == "mi355x" and variant == "mxfp8"):
        raise LaunchError(
            f"high_concurrency with {variant} on {hw}: the recipe documents it only as \"MXFP8 high-concurrency "
            "options on MI355X\""
        )
    draft_fields = {"draft_head", "draft_attention_backend", "draft_local_argmax_reduction"} & spec.model_fields_set
    if draft_fields and not spec.speculative_decoding:
        raise LaunchError(f"{', '.join(sorted(draft_fields))} set but speculative_decoding is off")
    if spec.collect_detailed_traces is not None and spec.otlp_traces_endpoint is None:
        raise LaunchError("collect_detailed_traces needs otlp_traces_endpoint")
    if spec.otlp_traces_protocol is not None and spec.otlp_traces_endpoint is None:
        raise LaunchError("otlp_traces_protocol needs otlp_traces_endpoint")
    if spec.kv_events and "PYTHONHASHSEED" in spec.extra_env:
        raise LaunchError("PYTHONHASHSEED seeds vLLM's prefix hashes: with kv_events the gateway could not reproduce them")
    if spec.kv_events:
        ports = {*spec.kv_events_ports, spec.kv_events_replay_port}
        if spec.port in ports:
            raise LaunchError(f"port {spec.port} collides with the KV events ports {sorted(ports)}")
    owned = sorted({a.split("=", 1)[0] for a in spec.extra_args} & OWNED_FLAGS)
    if owned:
        raise LaunchError(f"extra_args sets {', '.join(owned)}: use the launch fields instead, the renderer owns them")


def _build(spec: LaunchSpec, pool: PoolLike, served_model: str | None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one replica; raises LaunchError for what only the pool can reveal."""
    hw, variant, amd = spec.hardware, spec.variant, spec.is_amd
    if pool.block_size != BLOCK_SIZE:
        raise LaunchError(
            f"pool block_size {pool.block_size}: the recipe says \"--block-size 128 is mandatory on every platform "
            "(MSA sparse/index cache)\""
        )
    length = pool.max_model_len
    if length > MAX_CONTEXT:
        raise LaunchError(f"max_model_len {length} exceeds MiniMax-M3's full window (context_length: {MAX_CONTEXT})")
    multimodal = any(m != "text" for m in pool.modalities)
    if spec.text_only is True and multimodal:
        raise LaunchError(
            f"text_only on a pool accepting {', '.join(pool.modalities)}: --language-model-only skips loading the "
            "vision encoder, so the replicas would reject images and video"
        )
    text_only = not multimodal if spec.text_only is None else spec.text_only
    if text_only and spec.encoder_parallel is True:
        raise LaunchError(
            "encoder_parallel on a text-only pool: the recipe says Text only (--language-model-only) \"is mutually "
            "exclusive with Encoder Parallel\""
        )

    env: dict[str, str] = {}
    args: list[str] = ["vllm", "serve", spec.checkpoint]
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.data_parallel_size > 1:
        args += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.expert_parallel:
        args.append("--enable-expert-parallel")
    if variant in ("nvfp4", "mxfp4"):
        args.append("--trust-remote-code")
    args += ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(length)]
    if text_only:
        args.append("--language-model-only")

    if variant == "nvfp4":
        env["VLLM_FLOAT32_MATMUL_PRECISION"] = "high"
    if amd:
        # "It avoids the MiniMax-M3 decode breakable-cudagraph path that would otherwise force eager execution"
        env["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
        args += ["--attention-backend", "TRITON_ATTN"]
    if spec.online_quantization == "fp8_per_channel":
        env["VLLM_ROCM_USE_AITER"] = "1"
        env["VLLM_ROCM_USE_AITER_MOE"] = "0"
        args += ["--quantization", "fp8_per_channel"]
    if hw == "mi300x" and variant == "mxfp8":
        env.update({
            "VLLM_ENGINE_READY_TIMEOUT_S": "3600",
            "VLLM_ROCM_USE_AITER": "1",
            "VLLM_ROCM_USE_AITER_MHA": "0",
            "TORCH_BLAS_PREFER_HIPBLASLT": "1",
            "NCCL_MIN_NCHANNELS": "112",
            "GPU_MAX_HW_QUEUES": "2",
        })
        args += ["--async-scheduling", "--max-num-batched-tokens", "16384"]
    if hw == "mi355x" and variant == "mxfp8":
        env.update({
            "VLLM_ROCM_USE_AITER": "1",
            "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",
            "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION": "INT4",
        })
    if spec.high_concurrency:
        env.update({
            "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1",
            "VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16": "0",
            "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION_MIN_SIZE_KB": "256",
        })
        args += ["--moe-backend", "aiter", "--max-num-batched-tokens", "32768", "--linear-backend", "emulation"]

    beyond_native = length > NATIVE_CONTEXT
    kv_dtype = spec.kv_cache_dtype
    if kv_dtype is None:
        # "TP=8 + fp8 KV is the practical combo at 1M"; the MI355X high-concurrency command carries it too.
        kv_dtype = "fp8" if beyond_native or spec.high_concurrency else "auto"
    if kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if amd and beyond_native:
        # "Native context is 512K. To go past it, supply a YaRN rope_scaling on the text config"
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        args += ["--hf-overrides", json.dumps(YARN_OVERRIDES, separators=(",", ":"))]

    encoder_flags = spec.encoder_parallel if spec.encoder_parallel is not None else (amd and not text_only)
    if encoder_flags:
        args += ["--mm-encoder-tp-mode", "data", "--mm-encoder-attn-backend", "ROCM_AITER_FA" if amd else "FLASHINFER"]
        if spec.encoder_parallel is True:
            args += ["--mm-processor-cache-type", "shm"]

    if spec.speculative_decoding:
        draft: dict[str, object] = {"method": "eagle3", "model": EAGLE3_DRAFTS[spec.draft_head], "num_speculative_tokens": 3}
        backend = spec.draft_attention_backend or (None if amd else "FLASH_ATTN")
        if backend is not None:
            draft["attention_backend"] = backend
        if spec.draft_local_argmax_reduction:
            draft["use_local_argmax_reduction"] = True
        args += ["--speculative-config", json.dumps(draft)]

    args += ["--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3", "--enable-auto-tool-choice"]

    # What the gateway needs from every replica.
    if served_model is not None and served_model != spec.checkpoint:
        args += ["--served-model-name", served_model]
    args += ["--port", str(spec.port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--enable-server-load-tracking"]
    if pool.scheduling_policy != "fcfs":  # the gateway sends each request's class priority in the body
        args += ["--scheduling-policy", pool.scheduling_policy]
    if spec.kv_events:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{spec.kv_events_port}",
            "replay_endpoint": f"tcp://*:{spec.kv_events_replay_port}",
            "topic": "kv",
        }
        args += ["--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if spec.otlp_traces_endpoint is not None:
        args += ["--otlp-traces-endpoint", spec.otlp_traces_endpoint]
        env["OTEL_SERVICE_NAME"] = f"vllm-{pool.name}"
        protocol = spec.otlp_traces_protocol
        if protocol is None and spec.otlp_traces_endpoint.split("?", 1)[0].rstrip("/").endswith("/v1/traces"):
            protocol = "http/protobuf"
        if protocol is not None:
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = protocol
        if spec.collect_detailed_traces is not None:
            args += ["--collect-detailed-traces", spec.collect_detailed_traces]
    args += list(spec.extra_args)

    clash = sorted(set(spec.extra_env) & set(env))
    if clash:
        raise LaunchError(f"extra_env overrides {', '.join(clash)}, which the recipe sets for {hw}/{variant}")
    env.update(spec.extra_env)
    return args, env
