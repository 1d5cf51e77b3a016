"""/metrics: the names, types and labels the gateway scrapes, and that the counters move as vLLM's do."""

from __future__ import annotations

import httpx

from tests.contract.support import (
    BLOCK_SIZE,
    SERVED_MODEL,
    eventually,
    expected_cached,
    random_token_ids,
    sample_value,
    scrape,
)

# Family names as the exposition parser reports them (counters without `_total`), with their types.
REQUIRED_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:external_prefix_cache_queries": "counter",
    "vllm:external_prefix_cache_hits": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:prompt_tokens_cached_by_source": "counter",
    "vllm:mm_cache_queries": "counter",
    "vllm:mm_cache_hits": "counter",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:estimated_flops_per_gpu": "counter",
    "vllm:estimated_read_bytes_per_gpu": "counter",
    "vllm:estimated_write_bytes_per_gpu": "counter",
    "vllm:tool_call_parser_invocations": "counter",
    "vllm:admission_rejections": "counter",
}
# Families exported without the engine label (contract section 5).
NO_ENGINE_LABEL = {"vllm:cache_config_info", "vllm:admission_rejections", "vllm:tool_call_parser_invocations"}
GONE_IN_0_32 = ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds")
ENGINE_LABELS = {"engine": "0", "model_name": SERVED_MODEL}
# Every CacheConfig field of vLLM 0.32, plus the engine.
CACHE_CONFIG_LABELS = {
    "_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens", "effective_attention_block_size",
    "enable_mamba_shared_prefix_checkpoint", "enable_prefix_caching", "engine", "gpu_memory_utilization",
    "hash_block_size", "is_attention_free", "kv_cache_dtype_skip_layers", "kv_cache_layout",
    "kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_offloading_backend",
    "kv_offloading_size", "kv_sharing_fast_prefill", "mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode",
    "mamba_page_size_padded", "mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
    "prefix_cache_retention_interval", "prefix_caching_hash_algo", "prefix_match_unit", "replayssm_buffer_len",
    "skip_page_size_padded", "sliding_window", "swa_bounded_replay", "use_kda_recoverssm", "use_replayssm",
    "user_specified_block_size",
}  # fmt: skip


async def test_metric_names_types_and_labels(client: httpx.AsyncClient) -> None:
    families = await scrape(client)
    for name, type_ in REQUIRED_FAMILIES.items():
        assert name in families, f"{name} missing"
        assert families[name].type == type_, f"{name} is a {families[name].type}, not a {type_}"
        if name not in NO_ENGINE_LABEL:
            for sample_name, labels, _ in families[name].samples:
                assert ENGINE_LABELS.items() <= labels.items(), f"{sample_name} labels {labels}"
    for name in GONE_IN_0_32:
        assert name not in families

    [(_, config_labels, config_value)] = families["vllm:cache_config_info"].samples
    assert config_value == 1.0
    assert "model_name" not in config_labels and config_labels["engine"] == "0"
    assert config_labels["block_size"] == str(BLOCK_SIZE)
    assert config_labels["enable_prefix_caching"] == "True"
    assert int(config_labels["num_gpu_blocks"]) > 0
    assert set(config_labels) == CACHE_CONFIG_LABELS
    size_tokens = int(config_labels["kv_cache_size_tokens"])
    assert size_tokens == int(config_labels["num_gpu_blocks"]) * BLOCK_SIZE
    assert float(config_labels["kv_cache_max_concurrency"]) == size_tokens / 2048

    reasons = {labels["finished_reason"] for _, labels, _ in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}, "every reason is exported from the start"
    waiting_reasons = {labels["reason"] for _, labels, _ in families["vllm:num_requests_waiting_by_reason"].samples}
    assert waiting_reasons == {"capacity", "deferred"}
    sources = {labels["source"] for _, labels, _ in families["vllm:prompt_tokens_by_source"].samples}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    tiers = {labels["source"] for _, labels, _ in families["vllm:prompt_tokens_cached_by_source"].samples}
    assert tiers == {"device", "host", "p2p", "disk", "external_unspecified"}
    sleep = {labels["sleep_state"]: value for _, labels, value in families["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    parser_labels = {
        (labels["mode"], labels["outcome"], labels["request_type"])
        for name, labels, _ in families["vllm:tool_call_parser_invocations"].samples
        if name.endswith("_total")
    }
    assert len(parser_labels) == 12, "(non_)streaming x (no_)tool_call x chat_completions|responses|other"

    def bounds(name: str) -> list[float]:
        return [float(labels["le"]) for n, labels, _ in families[name].samples if n.endswith("_bucket")]

    assert bounds("vllm:request_params_n") == [1.0, 2.0, 5.0, 10.0, 20.0, float("inf")]
    assert bounds("vllm:request_num_preemptions") == [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, float("inf")]
    assert bounds("vllm:request_prefill_kv_computed_tokens") == bounds("vllm:request_prompt_tokens")
    assert bounds("vllm:request_max_num_generation_tokens") == bounds("vllm:request_prompt_tokens")
    rejections = families["vllm:admission_rejections"].samples
    assert {labels["reason"] for _, labels, _ in rejections} == {"max_num_queued_reqs", "max_num_queued_tokens"}
    assert all(set(labels) == {"model_name", "reason"} for _, labels, _ in rejections)


async def test_counters_move_with_requests(client: httpx.AsyncClient) -> None:
    prompt = random_token_ids(5 * BLOCK_SIZE + 17)
    before = await scrape(client)

    def grew(after: dict, name: str, **labels: str) -> float:
        return sample_value(after, name, **labels) - sample_value(before, name, **labels)

    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 3, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=body)).status_code == 200

    async def first_request_counted() -> bool:
        return grew(await scrape(client), "vllm:request_success_total", finished_reason="length") >= 1

    assert await eventually(first_request_counted)
    after_first = await scrape(client)
    assert grew(after_first, "vllm:prompt_tokens_total") == len(prompt)
    assert grew(after_first, "vllm:generation_tokens_total") == 3
    assert grew(after_first, "vllm:prefix_cache_queries_total") == len(prompt)
    assert grew(after_first, "vllm:prefix_cache_hits_total") == 0
    assert grew(after_first, "vllm:e2e_request_latency_seconds_count") == 1
    assert grew(after_first, "vllm:request_prompt_tokens_sum") == len(prompt)
    assert grew(after_first, "vllm:time_to_first_token_seconds_count") == 1
    assert grew(after_first, "vllm:request_prefill_kv_computed_tokens_sum") == len(prompt)
    assert grew(after_first, "vllm:request_max_num_generation_tokens_sum") == 3
    assert grew(after_first, "vllm:request_params_n_sum") == 1
    assert grew(after_first, "vllm:request_params_max_tokens_sum") == 3
    assert grew(after_first, "vllm:request_num_preemptions_count") == 1
    assert grew(after_first, "vllm:prompt_tokens_by_source_total", source="local_compute") == len(prompt)

    before = after_first
    repeat = await client.post("/v1/completions", json=body)
    cached = repeat.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == expected_cached(len(prompt)) == 5 * BLOCK_SIZE

    async def repeat_counted() -> bool:
        return grew(await scrape(client), "vllm:request_success_total", finished_reason="length") >= 1

    assert await eventually(repeat_counted)
    after_repeat = await scrape(client)
    assert grew(after_repeat, "vllm:prefix_cache_queries_total") == len(prompt)
    assert grew(after_repeat, "vllm:prefix_cache_hits_total") == cached
    assert grew(after_repeat, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert grew(after_repeat, "vllm:prompt_tokens_by_source_total", source="local_compute") == len(prompt) - cached
    assert grew(after_repeat, "vllm:prompt_tokens_cached_total") == cached
    assert grew(after_repeat, "vllm:prompt_tokens_cached_by_source_total", source="device") == cached
    assert grew(after_repeat, "vllm:request_prefill_kv_computed_tokens_sum") == len(prompt) - cached


async def test_n_samples_are_engine_requests_observed_once_as_a_group(client: httpx.AsyncClient) -> None:
    before = await scrape(client)

    def grew(after: dict, name: str, **labels: str) -> float:
        return sample_value(after, name, **labels) - sample_value(before, name, **labels)

    body = {"model": SERVED_MODEL, "prompt": random_token_ids(40), "max_tokens": 2, "ignore_eos": True, "n": 3}
    assert (await client.post("/v1/completions", json=body)).status_code == 200

    async def counted() -> bool:
        return grew(await scrape(client), "vllm:request_params_n_count") >= 1

    assert await eventually(counted)
    after = await scrape(client)
    assert grew(after, "vllm:request_success_total", finished_reason="length") == 3, "one per sample"
    assert grew(after, "vllm:generation_tokens_total") == 6
    assert grew(after, "vllm:request_params_n_sum") == 3
    assert grew(after, "vllm:request_max_num_generation_tokens_sum") == 2


async def test_running_and_waiting_gauges_are_zero_when_idle(client: httpx.AsyncClient) -> None:
    families = await scrape(client)
    assert sample_value(families, "vllm:num_requests_running") == 0
    assert sample_value(families, "vllm:num_requests_waiting") == 0
    assert 0.0 <= sample_value(families, "vllm:kv_cache_usage_perc") <= 1.0
