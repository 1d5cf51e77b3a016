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
from collections.abc import Callable, Mapping, Sequence
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
    "--scheduling-policy", "--kv-transfer-config", "--shutdown-timeout",
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
    shutdown_timeout_s: int = Field(
        default=60, ge=0, le=86_400,
        description="--shutdown-timeout: on SIGTERM vLLM refuses new requests and lets those in flight finish for up "
        "to this many seconds (0 aborts them at once). Kubernetes' terminationGracePeriodSeconds must exceed the "
        "preStop sleep plus this (deploy/k8s).",
    )
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
        reasons = incompatibilities(self)
        if reasons:
            raise LaunchError(reasons[0])
        return self

    def check_pool(self, pool: PoolLike) -> None:
        """Raise LaunchError if this spec cannot serve `pool` (called by the pool config's validator)."""
        reasons = pool_refusals(self, pool)
        if reasons:
            raise LaunchError(reasons[0])


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
        header = (f"# pool {c.pool}, {c.role + ' ' if c.role else ''}replica {c.replica}: image {c.image}, "
                  f"{c.gpus} GPU(s) ({c.gpu_resource}), port {c.port}")
        if c.kv_events_ports:
            header += f", KV events on {', '.join(map(str, c.kv_events_ports))}"
        blocks.append(f"{header}\n{c.shell}\n")
    return "\n".join(blocks)


# ---------------------------------------------------------------------------------------------------------------
# Refusals: what the recipe rules out, in its own words (the first reason is the one reported)


def refusals(spec: LaunchSpec, pool: PoolLike) -> list[str]:
    """Why `spec` cannot launch `pool`'s replicas; [] when it can."""
    return [*incompatibilities(spec), *pool_refusals(spec, pool)]


def incompatibilities(spec: LaunchSpec) -> list[str]:
    """Why the recipe rules out `spec` whatever the pool; [] when it does not."""
    return [*_checkpoint_refusals(spec), *_feature_refusals(spec)]


def _checkpoint_refusals(spec: LaunchSpec) -> list[str]:
    """The checkpoint against the hardware and the GPUs of one replica."""
    hw, variant, gpus = spec.hardware, spec.variant, spec.gpus_per_replica
    reasons = []
    if variant == "nvfp4" and hw not in BLACKWELL:
        reasons.append(
            f"variant nvfp4 on {hw}: the NVFP4 checkpoint is for NVIDIA Blackwell only (recipe: \"Quantized Variant "
            "(NVFP4 on Blackwell)\"; B200, B300 or GB200)"
        )
    if variant == "mxfp4" and hw != "mi355x":
        reasons.append(
            f"variant mxfp4 on {hw}: the recipe says amd/MiniMax-M3-MXFP4 \"targets AMD Instinct MI355X (gfx950)\""
        )
    if spec.is_amd and variant == "bf16" and gpus < 8:
        reasons.append(f"bf16 on {hw} with {gpus} GPUs: the recipe says \"BF16 needs TP=8; the MXFP8 variant runs "
                       "from TP=4.\"")
    if spec.is_amd and variant == "mxfp8" and gpus < 4:
        reasons.append(f"mxfp8 on {hw} with {gpus} GPUs: the recipe says \"the MXFP8 variant runs from TP=4.\"")
    per_node = GPUS_PER_NODE.get(hw, DEFAULT_GPUS_PER_NODE)
    if gpus > per_node:
        reasons.append(
            f"{gpus} GPUs per replica on {hw} spans nodes ({per_node} per node): multi-node strategies "
            "(recipe: \"multi-node strategies also need nodes=<n>\") are not rendered here"
        )
    return reasons


def _feature_refusals(spec: LaunchSpec) -> list[str]:
    """Features the recipe keeps apart, or that need another setting."""
    hw, variant = spec.hardware, spec.variant
    reasons = []
    if spec.text_only is True and spec.encoder_parallel is True:
        reasons.append("text_only with encoder_parallel: the recipe says Text only (--language-model-only) \"is "
                       "mutually exclusive with Encoder Parallel\"")
    if spec.online_quantization is not None and not (spec.is_amd and variant == "bf16"):
        reasons.append(
            f"online_quantization {spec.online_quantization} with {variant} on {hw}: the recipe's AMD "
            "--quantization fp8_per_channel recipe says \"These env vars and the flag are for the BF16 checkpoint "
            "only.\""
        )
    if spec.high_concurrency and not (hw == "mi355x" and variant == "mxfp8"):
        reasons.append(f"high_concurrency with {variant} on {hw}: the recipe documents it only as \"MXFP8 "
                       "high-concurrency options on MI355X\"")
    draft_fields = {"draft_head", "draft_attention_backend", "draft_local_argmax_reduction"} & spec.model_fields_set
    if draft_fields and not spec.speculative_decoding:
        reasons.append(f"{', '.join(sorted(draft_fields))} set but speculative_decoding is off")
    if spec.collect_detailed_traces is not None and spec.otlp_traces_endpoint is None:
        reasons.append("collect_detailed_traces needs otlp_traces_endpoint")
    if spec.otlp_traces_protocol is not None and spec.otlp_traces_endpoint is None:
        reasons.append("otlp_traces_protocol needs otlp_traces_endpoint")
    if spec.kv_events and "PYTHONHASHSEED" in spec.extra_env:
        reasons.append("PYTHONHASHSEED seeds vLLM's prefix hashes: with kv_events the gateway could not reproduce them")
    ports = {*spec.kv_events_ports, spec.kv_events_replay_port}
    if spec.kv_events and spec.port in ports:
        reasons.append(f"port {spec.port} collides with the KV events ports {sorted(ports)}")
    owned = sorted({a.split("=", 1)[0] for a in spec.extra_args} & OWNED_FLAGS)
    if owned:
        reasons.append(f"extra_args sets {', '.join(owned)}: use the launch fields instead, the renderer owns them")
    return reasons


def pool_refusals(spec: LaunchSpec, pool: PoolLike) -> list[str]:
    """What only the pool reveals: its block size, length and modalities against the spec, and `extra_env`
    against the environment the recipe sets for this pool."""
    reasons = []
    if pool.block_size != BLOCK_SIZE:
        reasons.append(f"pool block_size {pool.block_size}: the recipe says \"--block-size 128 is mandatory on every "
                       "platform (MSA sparse/index cache)\"")
    if pool.max_model_len > MAX_CONTEXT:
        reasons.append(f"max_model_len {pool.max_model_len} exceeds MiniMax-M3's full window (context_length: "
                       f"{MAX_CONTEXT})")
    replica = ReplicaLaunch(spec, pool)
    if spec.text_only is True and replica.multimodal:
        reasons.append(f"text_only on a pool accepting {', '.join(pool.modalities)}: --language-model-only skips "
                       "loading the vision encoder, so the replicas would reject images and video")
    if replica.text_only and spec.encoder_parallel is True:
        reasons.append("encoder_parallel on a text-only pool: the recipe says Text only (--language-model-only) \"is "
                       "mutually exclusive with Encoder Parallel\"")
    clash = sorted(set(spec.extra_env) & set(recipe_env(replica)))
    if clash:
        reasons.append(f"extra_env overrides {', '.join(clash)}, which the recipe sets for "
                       f"{spec.hardware}/{spec.variant}")
    return reasons


# ---------------------------------------------------------------------------------------------------------------
# The recipe, rule by rule: each rule is the (args, env) it adds to one replica's command, nothing when it does
# not apply; `RULES` is their order on the command line.

Fragment = tuple[list[str], dict[str, str]]


@dataclass(frozen=True)
class ReplicaLaunch:
    """What the rules read: the spec, the pool it launches, and the model id it serves under (None: unnamed)."""

    spec: LaunchSpec
    pool: PoolLike
    served_model: str | None = None

    @property
    def multimodal(self) -> bool:
        return any(m != "text" for m in self.pool.modalities)

    @property
    def text_only(self) -> bool:
        """--language-model-only: the spec's choice, else exactly when the pool accepts only text."""
        return not self.multimodal if self.spec.text_only is None else self.spec.text_only

    @property
    def beyond_native(self) -> bool:
        return self.pool.max_model_len > NATIVE_CONTEXT


def serve(r: ReplicaLaunch) -> Fragment:
    """The checkpoint and its parallelism."""
    spec = r.spec
    args = ["vllm", "serve", spec.checkpoint]
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.data_parallel_size > 1:
        args += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.expert_parallel:
        args.append("--enable-expert-parallel")
    return args, {}


def remote_code(r: ReplicaLaunch) -> Fragment:
    """The NVFP4 and MXFP4 checkpoints' commands carry --trust-remote-code."""
    return (["--trust-remote-code"] if r.spec.variant in ("nvfp4", "mxfp4") else []), {}


def block_and_length(r: ReplicaLaunch) -> Fragment:
    """The mandatory block size, and the pool's context length."""
    return ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(r.pool.max_model_len)], {}


def language_model_only(r: ReplicaLaunch) -> Fragment:
    """Text only skips loading the vision encoder."""
    return (["--language-model-only"] if r.text_only else []), {}


def nvfp4_precision(r: ReplicaLaunch) -> Fragment:
    return [], ({"VLLM_FLOAT32_MATMUL_PRECISION": "high"} if r.spec.variant == "nvfp4" else {})


def amd_baseline(r: ReplicaLaunch) -> Fragment:
    """Every AMD command: CUDA graphs without the breakable path, Triton attention."""
    if not r.spec.is_amd:
        return [], {}
    return ["--attention-backend", "TRITON_ATTN"], {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}


def online_fp8(r: ReplicaLaunch) -> Fragment:
    """AMD, BF16 checkpoint: online per-channel FP8 (PTPC)."""
    if r.spec.online_quantization != "fp8_per_channel":
        return [], {}
    return ["--quantization", "fp8_per_channel"], {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MOE": "0"}


def mi300x_mxfp8(r: ReplicaLaunch) -> Fragment:
    """MXFP8 on MI300X: the InferenceX tuning's environment and scheduling levers."""
    if not (r.spec.hardware == "mi300x" and r.spec.variant == "mxfp8"):
        return [], {}
    env = {
        "VLLM_ENGINE_READY_TIMEOUT_S": "3600",
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_MHA": "0",
        "TORCH_BLAS_PREFER_HIPBLASLT": "1",
        "NCCL_MIN_NCHANNELS": "112",
        "GPU_MAX_HW_QUEUES": "2",
    }
    return ["--async-scheduling", "--max-num-batched-tokens", "16384"], env


def mi355x_mxfp8(r: ReplicaLaunch) -> Fragment:
    """MXFP8 on MI355X: AITER kernels, fused shared experts, INT4 QuickReduce."""
    if not (r.spec.hardware == "mi355x" and r.spec.variant == "mxfp8"):
        return [], {}
    return [], {
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",
        "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION": "INT4",
    }


def high_concurrency(r: ReplicaLaunch) -> Fragment:
    """MI355X MXFP8 at long context and high concurrency: AITER page-16 sparse paged attention."""
    if not r.spec.high_concurrency:
        return [], {}
    env = {
        "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1",
        "VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16": "0",
        "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION_MIN_SIZE_KB": "256",
    }
    return ["--moe-backend", "aiter", "--max-num-batched-tokens", "32768", "--linear-backend", "emulation"], env


def kv_cache_dtype(r: ReplicaLaunch) -> Fragment:
    """FP8 KV when asked, else past the native context ("TP=8 + fp8 KV is the practical combo at 1M") and in the
    MI355X high-concurrency command, which carries it."""
    dtype = r.spec.kv_cache_dtype
    if dtype is None:
        dtype = "fp8" if r.beyond_native or r.spec.high_concurrency else "auto"
    return (["--kv-cache-dtype", "fp8"] if dtype == "fp8" else []), {}


def amd_long_context(r: ReplicaLaunch) -> Fragment:
    """AMD past the native 512K: a YaRN rope_scaling on the text config, and the long max length allowed."""
    if not (r.spec.is_amd and r.beyond_native):
        return [], {}
    return ["--hf-overrides", json.dumps(YARN_OVERRIDES, separators=(",", ":"))], {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


def encoder_parallel(r: ReplicaLaunch) -> Fragment:
    """The vision encoder data-parallel with its attention backend (the AMD multimodal commands' default); the
    shared-memory processor cache only when Encoder Parallel is asked for."""
    spec = r.spec
    wanted = spec.encoder_parallel if spec.encoder_parallel is not None else (spec.is_amd and not r.text_only)
    if not wanted:
        return [], {}
    backend = "ROCM_AITER_FA" if spec.is_amd else "FLASHINFER"
    args = ["--mm-encoder-tp-mode", "data", "--mm-encoder-attn-backend", backend]
    if spec.encoder_parallel is True:
        args += ["--mm-processor-cache-type", "shm"]
    return args, {}


def speculative(r: ReplicaLaunch) -> Fragment:
    """EAGLE3 with 3 speculative tokens: the MHA or GQA draft head, FLASH_ATTN draft attention on NVIDIA."""
    spec = r.spec
    if not spec.speculative_decoding:
        return [], {}
    draft: dict[str, object] = {"method": "eagle3", "model": EAGLE3_DRAFTS[spec.draft_head],
                                "num_speculative_tokens": 3}
    backend = spec.draft_attention_backend or (None if spec.is_amd else "FLASH_ATTN")
    if backend is not None:
        draft["attention_backend"] = backend
    if spec.draft_local_argmax_reduction:
        draft["use_local_argmax_reduction"] = True
    return ["--speculative-config", json.dumps(draft)], {}


def parsers(r: ReplicaLaunch) -> Fragment:
    """Both parsers are minimax_m3, with automatic tool choice."""
    return ["--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3", "--enable-auto-tool-choice"], {}


def served_model_name(r: ReplicaLaunch) -> Fragment:
    """The gateway's model id, when it is not the checkpoint's."""
    model = r.served_model
    return (["--served-model-name", model] if model is not None and model != r.spec.checkpoint else []), {}


def gateway_observes(r: ReplicaLaunch) -> Fragment:
    """What the gateway reads from every replica: prefix caching, cached-token counts, the server's load."""
    return ["--port", str(r.spec.port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enable-server-load-tracking"], {}


def scheduling_policy(r: ReplicaLaunch) -> Fragment:
    """Priority scheduling: the gateway sends each request's class priority in the body."""
    policy = r.pool.scheduling_policy
    return (["--scheduling-policy", policy] if policy != "fcfs" else []), {}


def kv_events(r: ReplicaLaunch) -> Fragment:
    """KV events for precise prefix routing, with a hash the gateway can reproduce in Python (sha256_cbor)."""
    spec = r.spec
    if not spec.kv_events:
        return [], {}
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{spec.kv_events_port}",
        "replay_endpoint": f"tcp://*:{spec.kv_events_replay_port}",
        "topic": "kv",
    }
    config = json.dumps(events, separators=(",", ":"))
    return ["--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", config], {}


def tracing(r: ReplicaLaunch) -> Fragment:
    """vLLM's OTLP traces, named after the pool; http/protobuf towards a `/v1/traces` receiver (the gateway's)."""
    spec = r.spec
    endpoint = spec.otlp_traces_endpoint
    if endpoint is None:
        return [], {}
    args = ["--otlp-traces-endpoint", endpoint]
    env = {"OTEL_SERVICE_NAME": f"vllm-{r.pool.name}"}
    protocol = spec.otlp_traces_protocol
    if protocol is None and endpoint.split("?", 1)[0].rstrip("/").endswith("/v1/traces"):
        protocol = "http/protobuf"
    if protocol is not None:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = protocol
    if spec.collect_detailed_traces is not None:
        args += ["--collect-detailed-traces", spec.collect_detailed_traces]
    return args, env


def graceful_shutdown(r: ReplicaLaunch) -> Fragment:
    """On SIGTERM (a rolling restart, a node drain) the replica refuses new requests, which the gateway then sends
    elsewhere, and finishes those in flight for up to `shutdown_timeout_s` instead of aborting them (vLLM's 0)."""
    return ["--shutdown-timeout", str(r.spec.shutdown_timeout_s)], {}


def extra_args(r: ReplicaLaunch) -> Fragment:
    return list(r.spec.extra_args), {}


RULES: tuple[Callable[[ReplicaLaunch], Fragment], ...] = (
    serve, remote_code, block_and_length, language_model_only, nvfp4_precision, amd_baseline, online_fp8,
    mi300x_mxfp8, mi355x_mxfp8, high_concurrency, kv_cache_dtype, amd_long_context, encoder_parallel, speculative,
    parsers, served_model_name, gateway_observes, scheduling_policy, kv_events, tracing, graceful_shutdown, extra_args,
)


def recipe_env(r: ReplicaLaunch) -> dict[str, str]:
    """The environment the rules set for this replica (what `extra_env` may not override)."""
    env: dict[str, str] = {}
    for rule in RULES:
        env.update(rule(r)[1])
    return env


def _build(spec: LaunchSpec, pool: PoolLike, served_model: str | None) -> Fragment:
    """argv and environment of one replica; raises LaunchError for what only the pool can reveal."""
    reasons = pool_refusals(spec, pool)
    if reasons:
        raise LaunchError(reasons[0])
    replica = ReplicaLaunch(spec, pool, served_model)
    args: list[str] = []
    env: dict[str, str] = {}
    for rule in RULES:
        more_args, more_env = rule(replica)
        args += more_args
        env.update(more_env)
    env.update(spec.extra_env)
    return args, env
