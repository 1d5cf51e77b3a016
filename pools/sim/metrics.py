"""The replica's Prometheus metrics under vLLM 0.32's exact names, types, labels and buckets.

Each app owns its `CollectorRegistry` (no global state: several replicas may live in one test process). Gauges are
set from the engine at scrape time; counters and histograms are fed by the engine as things happen, so the numbers
follow from what the replica actually served.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1.0, *(float(2**i) for i in range(3, 15)))  # 1, 8, 16, ... 16384
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
CONTENT_TYPE = CONTENT_TYPE_LATEST


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exponent += 1


NUM_PREEMPTIONS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
NIXL_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)


def cache_config_labels(*, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool, hash_algo: str,
                        max_model_len: int, gpu_memory_utilization: float = 0.92) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels: every CacheConfig field of vLLM 0.32, valued as a GPU replica started
    with --block-size reports them (the KV size follows --kv-blocks; kv_cache_memory_bytes is only set by a
    user or by the CPU platform, so a GPU replica reports None)."""
    size_tokens = num_gpu_blocks * block_size
    return {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": str(enable_prefix_caching),
        "gpu_memory_utilization": str(gpu_memory_utilization), "hash_block_size": "None",
        "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(size_tokens / max_model_len), "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(size_tokens), "kv_offloading_backend": "native", "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False", "mamba_block_size": "None", "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none", "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(num_gpu_blocks), "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0", "prefix_caching_hash_algo": hash_algo, "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "True"}


class SimMetrics:
    def __init__(self, model_name: str, max_model_len: int, cache_labels: dict[str, str],
                 kv_connector: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        names = ["model_name", "engine"]
        lv = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**lv)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.", [*names, "reason"], registry=r)
        self.num_requests_waiting_by_reason = {reason: waiting_by_reason.labels(**lv, reason=reason)
                                               for reason in ("capacity", "deferred")}
        sleep_state = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*names, "sleep_state"], registry=r)
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep_state.labels(**lv, sleep_state=state).set(value)
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache_labels, "engine"],
                     registry=r)
        info.labels(**cache_labels, engine="0").set(1)

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
            "cache sharing, in terms of number of queried tokens.")
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
            "sharing, in terms of number of cached tokens.")
        self.mm_cache_queries = counter("vllm:mm_cache_queries",
                                        "Multi-modal cache queries, in terms of number of queried items.")
        self.mm_cache_hits = counter("vllm:mm_cache_hits",
                                     "Multi-modal cache hits, in terms of number of cached items.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*names, "source"],
                            registry=r)
        self.prompt_tokens_by_source = {src: by_source.labels(**lv, source=src) for src in PROMPT_SOURCES}
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", [*names, "source"],
            registry=r)
        self.prompt_tokens_cached_by_source = {src: cached_by_source.labels(**lv, source=src)
                                               for src in CACHED_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.request_success = {reason: success.labels(**lv, finished_reason=reason) for reason in FINISHED_REASONS}
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=r)
        self.admission_rejections = {reason: rejections.labels(model_name=model_name, reason=reason)
                                     for reason in ("max_num_queued_reqs", "max_num_queued_tokens")}

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                          token_buckets)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Number of generation tokens processed.", token_buckets)
        self.request_params_max_tokens = hist("vllm:request_params_max_tokens",
                                              "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                                     PARAMS_N_BUCKETS)
        self.request_num_preemptions = hist("vllm:request_num_preemptions",
                                            "Histogram of the number of times a request was preempted.",
                                            NUM_PREEMPTIONS_BUCKETS)
        self.request_prefill_kv_computed_tokens = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets)
        for name, doc in (("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU "
                           "(for Model Flops Utilization calculations)."),
                          ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU "
                           "(for Model Flops Utilization calculations)."),
                          ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU "
                           "(for Model Flops Utilization calculations).")):
            counter(name, doc)  # exported by vLLM 0.32 by default; they stay 0 without --enable-mfu-metrics
        invocations = Counter(
            "vllm:tool_call_parser_invocations", "Total number of ToolParser invocations. Non-streaming increments "
            "once per choice; streaming increments once per delta.", ["model_name", "mode", "outcome", "request_type"],
            registry=r)
        self.tool_call_parser_invocations = {
            (mode, outcome, kind): invocations.labels(model_name=model_name, mode=mode, outcome=outcome,
                                                      request_type=kind)
            for mode in ("streaming", "non_streaming") for outcome in ("tool_call", "no_tool_call")
            for kind in ("chat_completions", "responses", "other")}

        # NixlConnector's metrics (`nixl/stats.py`) exist only with a KV connector, as in vLLM.
        self.nixl = NixlMetrics(r, lv) if kv_connector else None

    def render(self, running: int, waiting: int, kv_usage: float, deferred: int = 0,
               names: Sequence[str] = ()) -> bytes:
        """`deferred`: requests waiting on something other than capacity (here: a KV transfer in flight). `names`:
        only these samples (vLLM's /metrics?name[]=..., prometheus_client's filter on sample names), else all."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting + deferred)
        self.num_requests_waiting_by_reason["capacity"].set(waiting)
        self.num_requests_waiting_by_reason["deferred"].set(deferred)
        self.kv_cache_usage.set(kv_usage)
        return generate_latest(self.registry.restricted_registry(names) if names else self.registry)


class NixlMetrics:
    """vLLM's NixlPromMetrics. The sim has no post time, byte counts or descriptors, so those histograms are left
    out; the counters count what the connector does (disagg.py)."""

    def __init__(self, r: CollectorRegistry, lv: dict[str, str]) -> None:
        names = list(lv)
        self.xfer_time = Histogram("vllm:nixl_xfer_time_seconds",
                                   "Histogram of transfer duration for NIXL KV Cache transfers.", names,
                                   buckets=NIXL_XFER_TIME_BUCKETS, registry=r).labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**lv)

        self.failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers, including handshake and "
            "notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.")
        self.failed_notifications = counter(
            "vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications. Retained for "
            "compatibility; these failures are also included in vllm:nixl_num_failed_transfers.")
        self.kv_expired_reqs = counter(
            "vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire. NOTE: This metric is "
            "tracked on the P instance.")
        self.notifications_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry", "Number of completion notifications for requests that were "
            "no longer tracked, usually because their KV lease expired. The KV blocks may have been reused before "
            "the transfer finished. Counted per notification (one per remote rank), not per request.")
