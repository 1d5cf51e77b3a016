"""Everything a simulated replica is started with, as one frozen value (the CLI builds it, tests may too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pools.sim.faults import FaultSettings

VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class CostModel:
    """How long engine steps take. Defaults approximate an H200 TP8 replica of a ~23B-active MoE.

    A step costs `decode_ms_per_step + decode_ms_per_seq * seqs_in_batch + prefill_us_per_token * prefill_tokens`,
    all divided by `speed`; `instant` drops every delay (the gateway overhead benchmark wants a zero-cost upstream).
    """

    prefill_us_per_token: float = 60.0
    decode_ms_per_step: float = 12.0
    decode_ms_per_seq: float = 0.05
    speed: float = 1.0
    instant: bool = False

    def step_seconds(self, num_seqs: int, prefill_tokens: int) -> float:
        if self.instant or num_seqs == 0:
            return 0.0
        ms = self.decode_ms_per_step + self.decode_ms_per_seq * num_seqs + self.prefill_us_per_token * prefill_tokens / 1000
        return ms / 1000.0 / self.speed


@dataclass(frozen=True)
class KVTransferSettings:
    """Prefill/decode disaggregation as vLLM's NixlConnector does it (`--kv-transfer-config`); see disagg.py.

    `role` "both" means no connector at all (vLLM without --kv-transfer-config: kv_transfer_params are ignored);
    "prefill"/"decode" start the connector as kv_producer/kv_consumer. Like NIXL, either role honours both kinds of
    request (the role is a label), so a proxy decides per request which side a replica plays."""

    role: str = "both"
    engine_id: str | None = None  # None: a uuid4 per start, as vLLM (so a restarted prefill replica is detected)
    ms_per_block: float = 0.05  # time the decode side spends pulling one KV block (divided by --speed)
    lease_duration_s: float = 30.0  # kv_connector_extra_config.kv_lease_duration: prefill holds blocks this long
    load_failure_policy: str = "fail"  # kv_load_failure_policy: "fail" (500) or "recompute" the prompt locally
    tp_size: int = 1  # reported as tp_size in kv_transfer_params

    @property
    def enabled(self) -> bool:
        return self.role != "both"


@dataclass(frozen=True)
class SimSettings:
    """One replica's configuration; field names follow the `vllm serve` flags they imitate."""

    model: str = "MiniMaxAI/MiniMax-M3"
    served_model_names: tuple[str, ...] = ()
    max_model_len: int = 32768
    host: str = "127.0.0.1"
    port: int = 8001
    # engine
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 128
    kv_blocks: int = 32768
    enable_prefix_caching: bool = True
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    cost: CostModel = field(default_factory=CostModel)
    # behaviour
    seed: int = 0
    modalities: tuple[str, ...] = ("text",)
    tokenizer_dir: str | None = None
    mean_output_tokens: int = 256
    tool_call_probability: float = 0.5
    adaptive_thinking_probability: float = 0.5
    image_tokens: int = 256
    video_tokens: int = 2048
    api_key: str | None = None
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON: publish KV events (pools/sim/kv_events.py)
    prefix_caching_hash_algo: str | None = None  # sha256_cbor / sha256: vLLM's own block hashes over the token ids
    hash_seed: str | None = None  # the process's PYTHONHASHSEED, which vLLM hashes into NONE_HASH (as vLLM reads it)
    kv_transfer: KVTransferSettings = field(default_factory=KVTransferSettings)
    shutdown_timeout: float = 0  # vLLM's --shutdown-timeout: seconds requests in flight may run after SIGTERM
    otlp_traces_endpoint: str | None = None  # vLLM's --otlp-traces-endpoint: llm_request spans (pools/sim/tracing.py)
    # fault injection at start (changeable later through POST /sim/faults)
    faults: FaultSettings = field(default_factory=FaultSettings)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names clients may send: --served-model-name values, else the model path itself (as vLLM)."""
        return self.served_model_names or (self.model,)

    @property
    def multimodal(self) -> bool:
        return any(m != "text" for m in self.modalities)
