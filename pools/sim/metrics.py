"""The replica's Prometheus metrics under vLLM 0.32's exact names, types, labels and buckets.

Each app owns its `CollectorRegistry` (no global state: several replicas may live in one test process). Gauges are
set from the engine at scrape time; counters and histograms are fed by the engine as things happen, so the numbers
follow from what the replica actually served.
"""

from __future__ import annotations

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


class SimMetrics:
    def __init__(self, model_name: str, max_model_len: int, cache_labels: dict[str, str]) -> None:
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
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache_labels, "engine"],
                     registry=r)
        info.labels(**cache_labels, engine="0").set(1)

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.request_success = {reason: success.labels(**lv, finished_reason=reason) for reason in FINISHED_REASONS}
        rejections = Counter("vllm:admission_rejections", "Requests rejected at admission (engine busy).",
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

    def render(self, running: int, waiting: int, kv_usage: float) -> bytes:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)
        return generate_latest(self.registry)
