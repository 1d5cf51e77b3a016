"""The simulator's engine model: prefix cache (whole blocks only, LRU, pinned while in use), batching, queueing,
chunked prefill, preemption, admission control, and the metrics that follow from them. Time is driven by hand."""

from __future__ import annotations

import pytest

from pools.sim.engine import Engine, EngineBusy, RequestGroup, SimRequest
from pools.sim.metrics import SimMetrics
from pools.sim.prefix_cache import block_hashes
from pools.sim.settings import CostModel
from pools.sim.tokenizer import ByteChunkTokenizer

TOKENIZER = ByteChunkTokenizer()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(*, blocks: int = 64, block_size: int = 16, seqs: int = 8, batched: int = 4096,
                queued: int | None = None) -> tuple[Engine, SimMetrics, Clock]:
    clock = Clock()
    metrics = SimMetrics("m", max_model_len=blocks * block_size, cache_labels={"block_size": str(block_size)})
    engine = Engine(num_blocks=blocks, block_size=block_size, max_num_seqs=seqs, max_num_batched_tokens=batched,
                    cost=CostModel(), metrics=metrics, max_num_queued_reqs=queued, clock=clock)
    return engine, metrics, clock


def text_of(tokens: int, tag: str) -> str:
    """A prompt of exactly `tokens` byte-chunk tokens whose content is determined by `tag`."""
    unit = (tag * 4)[:4]
    return unit * tokens


def request(engine: Engine, text: str, output: int = 4, block_size: int = 16) -> SimRequest:
    tokens = TOKENIZER.encode(text, False)
    return SimRequest(request_id=text[:8], prompt_tokens=tokens.count, block_hashes=block_hashes(tokens, block_size),
                      output_tokens=output, natural_finish="length", max_tokens=output, arrival=engine.clock())


def run_until_done(engine: Engine, clock: Clock, *reqs: SimRequest, limit: int = 10_000) -> None:
    for _ in range(limit):
        if all(r.finished for r in reqs):
            return
        clock.now += 0.01
        engine.step_now()
    raise AssertionError("requests did not finish")


def sample(metrics: SimMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    return 0.0 if value is None else value


def test_repeated_prompt_hits_whole_blocks_only() -> None:
    engine, _, clock = make_engine(blocks=64, block_size=128, batched=8192)
    first = request(engine, text_of(1202, "a"), block_size=128)
    engine.submit(first)
    run_until_done(engine, clock, first)
    second = request(engine, text_of(1202, "a"), block_size=128)
    engine.submit(second)
    run_until_done(engine, clock, second)
    assert (first.cached_tokens, second.cached_tokens) == (0, 1152)  # 9 full blocks of 128, as observed on vLLM


def test_prompt_of_exact_blocks_recomputes_its_last_block() -> None:
    engine, _, clock = make_engine(blocks=64, block_size=128, batched=8192)
    a = request(engine, text_of(1280, "b"), block_size=128)
    engine.submit(a)
    run_until_done(engine, clock, a)
    b = request(engine, text_of(1280, "b"), block_size=128)
    engine.submit(b)
    run_until_done(engine, clock, b)
    assert b.cached_tokens == 1152  # the last prompt token must be recomputed, so its whole block is


def test_shared_prefix_hits_up_to_the_first_difference() -> None:
    engine, _, clock = make_engine()
    a = request(engine, text_of(64, "p") + text_of(20, "x"))
    engine.submit(a)
    run_until_done(engine, clock, a)
    b = request(engine, text_of(64, "p") + text_of(20, "y"))
    engine.submit(b)
    run_until_done(engine, clock, b)
    assert b.cached_tokens == 64


def test_lru_eviction_keeps_the_most_recently_used_prompt() -> None:
    engine, _, clock = make_engine(blocks=20, block_size=16)
    older = request(engine, text_of(128, "A"), output=1)
    engine.submit(older)
    run_until_done(engine, clock, older)
    newer = request(engine, text_of(128, "B"), output=1)
    engine.submit(newer)
    run_until_done(engine, clock, newer)
    # 16 cached blocks now sit in 20; a third 8-block prompt must evict 4 of them: the older prompt's.
    third = request(engine, text_of(128, "C"), output=1)
    engine.submit(third)
    run_until_done(engine, clock, third)
    again_newer = request(engine, text_of(128, "B"), output=1)
    engine.submit(again_newer)
    run_until_done(engine, clock, again_newer)
    again_older = request(engine, text_of(128, "A"), output=1)
    engine.submit(again_older)
    run_until_done(engine, clock, again_older)
    assert again_newer.cached_tokens == 112  # all 7 hit-able blocks of B survived
    assert again_older.cached_tokens < 112  # A lost blocks to eviction


def test_eviction_takes_a_prompts_tail_before_its_head() -> None:
    engine, _, clock = make_engine(blocks=12, block_size=16)
    a = request(engine, text_of(128, "H"), output=1)
    engine.submit(a)
    run_until_done(engine, clock, a)
    filler = request(engine, text_of(96, "F"), output=1)  # 6 blocks: the 4 never used, then 2 of A's
    engine.submit(filler)
    run_until_done(engine, clock, filler)
    again = request(engine, text_of(128, "H"), output=1)
    engine.submit(again)
    run_until_done(engine, clock, again)
    assert again.cached_tokens == 96  # A's last two blocks went first; its head still hits


def test_blocks_of_running_requests_are_never_evicted_and_newcomers_queue() -> None:
    engine, metrics, clock = make_engine(blocks=10, block_size=16, seqs=4)
    running = request(engine, text_of(96, "R"), output=1000)  # 6 blocks, then keeps decoding
    engine.submit(running)
    clock.now += 0.01
    engine.step_now()
    cached_before = len(engine.prefix_cache or ())
    big = request(engine, text_of(96, "S"), output=1)  # needs 7 blocks; only 4 are free
    engine.submit(big)
    clock.now += 0.01
    engine.step_now()
    assert big.status == "waiting" and running.status == "running"
    assert len(engine.prefix_cache or ()) == cached_before  # nothing of the running prompt was evicted
    assert metrics.render(len(engine.running), len(engine.waiting), engine.kv.usage)  # renders while queued
    engine.abort(running)
    clock.now += 0.01
    engine.step_now()
    assert big.status in ("running", "finished")


def test_batch_limit_queues_the_rest_in_arrival_order() -> None:
    engine, _, clock = make_engine(seqs=2)
    reqs = [request(engine, text_of(20, tag), output=50) for tag in "xyz"]
    for r in reqs:
        engine.submit(r)
    clock.now += 0.01
    engine.step_now()
    assert [r.status for r in reqs] == ["running", "running", "waiting"]
    run_until_done(engine, clock, *reqs)
    assert reqs[2].scheduled_at is not None and reqs[2].scheduled_at > reqs[0].scheduled_at  # type: ignore


def test_long_prefill_is_chunked_by_the_token_budget() -> None:
    engine, _, clock = make_engine(blocks=256, block_size=16, batched=1024)
    r = request(engine, text_of(3000, "L"), output=2)
    engine.submit(r)
    steps = 0
    while r.num_output == 0:
        clock.now += 0.01
        engine.step_now()
        steps += 1
    assert steps == 3  # 1024 + 1024 + 952


def test_decode_shares_the_budget_with_prefill_chunks() -> None:
    engine, _, clock = make_engine(blocks=512, block_size=16, batched=1000)
    decoding = request(engine, text_of(10, "d"), output=100)
    engine.submit(decoding)
    clock.now += 0.01
    engine.step_now()
    long = request(engine, text_of(2000, "e"), output=2)
    engine.submit(long)
    clock.now += 0.01
    engine.step_now()
    assert long.num_computed == 999  # the decode took 1 token of the 1000 budget


def test_kv_pressure_preempts_the_newest_running_request() -> None:
    engine, metrics, clock = make_engine(blocks=8, block_size=16, seqs=4)
    a = request(engine, text_of(40, "P"), output=60)
    b = request(engine, text_of(40, "Q"), output=60)
    engine.submit(a)
    engine.submit(b)
    run_until_done(engine, clock, a, b)
    assert engine.counters.preemptions >= 1
    assert sample(metrics, "vllm:num_preemptions_total") == engine.counters.preemptions
    assert (a.num_output, b.num_output) == (60, 60)
    assert engine.kv.num_free == 8  # everything returned


def test_abort_frees_blocks_and_counts_as_abort() -> None:
    engine, metrics, clock = make_engine()
    r = request(engine, text_of(100, "z"), output=1000)
    engine.submit(r)
    clock.now += 0.01
    engine.step_now()
    assert engine.kv.num_free < 64
    engine.abort(r)
    assert r.finish_reason == "abort" and engine.kv.num_free == 64 and not engine.running
    assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1


def test_admission_control_rejects_when_the_queue_is_full() -> None:
    engine, metrics, _ = make_engine(queued=2)
    engine.submit(request(engine, text_of(10, "1")))
    engine.submit(request(engine, text_of(10, "2")))
    with pytest.raises(EngineBusy) as info:
        engine.submit(request(engine, text_of(10, "3")))
    assert "currently busy" in str(info.value)
    assert engine.counters.rejected == 1
    value = metrics.registry.get_sample_value("vllm:admission_rejections_total",
                                              {"model_name": "m", "reason": "max_num_queued_reqs"})
    assert value == 1


def test_metrics_follow_what_was_served() -> None:
    engine, metrics, clock = make_engine(blocks=64, block_size=16)
    first = request(engine, text_of(50, "m"), output=5)
    engine.submit(first)
    run_until_done(engine, clock, first)
    second = request(engine, text_of(50, "m"), output=5)
    engine.submit(second)
    run_until_done(engine, clock, second)
    assert sample(metrics, "vllm:prefix_cache_queries_total") == 100
    assert sample(metrics, "vllm:prefix_cache_hits_total") == 48
    assert sample(metrics, "vllm:prompt_tokens_total") == 100
    assert sample(metrics, "vllm:generation_tokens_total") == 10
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 2
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 2
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 8  # 4 gaps per 5-token answer
    assert sample(metrics, "vllm:e2e_request_latency_seconds_sum") > 0


def test_step_cost_grows_with_batch_and_uncached_prefill() -> None:
    cost = CostModel(prefill_us_per_token=60, decode_ms_per_step=12, decode_ms_per_seq=0.05, speed=1)
    assert cost.step_seconds(1, 0) < cost.step_seconds(100, 0)
    assert cost.step_seconds(1, 1000) == pytest.approx(0.01205 + 0.06)
    assert CostModel(speed=10).step_seconds(1, 1000) == pytest.approx(cost.step_seconds(1, 1000) / 10)
    assert CostModel(instant=True).step_seconds(50, 10_000) == 0


async def test_engine_loop_paces_steps_by_the_cost_model() -> None:
    import asyncio
    import time

    metrics = SimMetrics("m", max_model_len=4096, cache_labels={"block_size": "16"})
    engine = Engine(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096,
                    cost=CostModel(decode_ms_per_step=10, decode_ms_per_seq=0, prefill_us_per_token=0), metrics=metrics)
    engine.start()
    try:
        r = request(engine, text_of(10, "t"), output=11)
        started = time.monotonic()
        engine.submit(r)
        while not r.finished:
            await asyncio.wait_for(r.wake.wait(), 2)
            r.wake.clear()
        elapsed = time.monotonic() - started
    finally:
        await engine.stop()
    assert 0.09 <= elapsed < 0.5  # 11 steps of 10 ms


def test_prompt_token_sources_and_per_request_histograms() -> None:
    engine, metrics, clock = make_engine(blocks=64, block_size=16)
    first = request(engine, text_of(100, "s"), output=3)
    engine.submit(first)
    run_until_done(engine, clock, first)
    second = request(engine, text_of(100, "s"), output=3)
    engine.submit(second)
    run_until_done(engine, clock, second)
    assert second.cached_tokens == 96
    assert sample(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 100 + 4
    assert sample(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 96
    assert sample(metrics, "vllm:prompt_tokens_cached_total") == 96
    assert sample(metrics, "vllm:prompt_tokens_cached_by_source_total", source="device") == 96
    assert sample(metrics, "vllm:request_prefill_kv_computed_tokens_sum") == 104
    assert sample(metrics, "vllm:request_num_preemptions_count") == 2
    assert sample(metrics, "vllm:request_params_n_sum") == 2
    assert sample(metrics, "vllm:request_max_num_generation_tokens_sum") == 6
    assert sample(metrics, "vllm:request_params_max_tokens_sum") == 6


def test_a_group_of_samples_is_observed_once_when_its_last_member_finishes() -> None:
    engine, metrics, clock = make_engine()
    group = RequestGroup(n=3, remaining=3)
    members = []
    for i, output in enumerate((2, 5, 3)):
        req = request(engine, text_of(20, "g"), output=output)
        req.request_id, req.group = f"{i}_g", group
        members.append(req)
        engine.submit(req)
    run_until_done(engine, clock, *members)
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 3
    assert sample(metrics, "vllm:request_params_n_count") == 1 and sample(metrics, "vllm:request_params_n_sum") == 3
    assert sample(metrics, "vllm:request_max_num_generation_tokens_sum") == 5
