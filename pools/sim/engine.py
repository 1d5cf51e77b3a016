"""The simulated engine: vLLM v1's scheduler loop over a paged KV cache, with modelled step times.

One asyncio task runs steps. A step schedules running requests first (a decode token each, or the next chunk of
their prefill), then admits waiting requests in FCFS order while the token budget (`max_num_batched_tokens`), the
batch size (`max_num_seqs`) and free KV blocks allow; a request that cannot get its blocks waits at the head of the
queue (vLLM's head-of-line behaviour). A running request that needs a new block when none is free preempts the
most recently admitted one, which loses its blocks and is recomputed later (prefix hits permitting).

The step then "runs" for the cost model's time (prefill ∝ uncached tokens, decode grows with the batch) and every
scheduled request advances: a finished prefill samples the first token, a decode samples the next. Handlers learn
of new tokens through the request's `wake` event; the engine never touches HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pools.sim.kv import KVCacheManager, blocks_for
from pools.sim.metrics import SimMetrics
from pools.sim.prefix_cache import CacheEventSink, PrefixCache
from pools.sim.settings import CostModel
from pools.tasks import cancel_and_wait


class EngineBusy(Exception):
    """Admission control refused the request (vLLM's 503 when --max-num-queued-reqs/-tokens is reached)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        if reason == "max_num_queued_tokens":
            msg = ("The engine has reached its prefill token backlog limit. Please try again later or on a "
                   "different instance.")
        else:
            msg = ("The engine is currently busy and cannot accept new requests. Please try again later or on a "
                   "different instance.")
        super().__init__(msg)


@dataclass(eq=False)
class RequestGroup:
    """The `n` samples of one API request (vLLM's ParentRequest): each is its own engine request; the group's
    `n` and longest output are observed once all of them have finished."""

    n: int
    remaining: int
    max_generation_tokens: int = 0


@dataclass(eq=False)
class SimRequest:
    """One generation request as the engine sees it: token counts, never text."""

    request_id: str
    prompt_tokens: int
    block_hashes: list[int]
    output_tokens: int  # how many tokens it will generate if not aborted (planned, <= max_tokens)
    natural_finish: str  # "stop" or "length": the finish reason when output_tokens are reached
    max_tokens: int
    arrival: float
    priority: int = 0
    group: RequestGroup | None = None
    # engine state
    status: str = "new"  # new | waiting | running | finished
    blocks: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # prompt blocks already stored in the prefix cache
    num_computed: int = 0  # tokens whose KV is computed
    prefill_target: int = 0  # tokens to compute before the next token is sampled (prompt, + outputs after preemption)
    cached_tokens: int = 0  # prefix-cache hit when first scheduled
    num_output: int = 0
    num_preemptions: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    trace_parent: tuple[int, int] | None = None  # (trace id, parent span id) of its traceparent (pools/sim/tracing.py)

    @property
    def finished(self) -> bool:
        return self.status == "finished"


@dataclass
class EngineCounters:
    completed: int = 0
    aborted: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


class Engine:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 cost: CostModel, metrics: SimMetrics, enable_prefix_caching: bool = True,
                 max_num_queued_reqs: int | None = None, max_num_queued_tokens: int | None = None,
                 cache_sink: CacheEventSink | None = None, clock: Callable[[], float] = time.monotonic,
                 finish_sink: Callable[[SimRequest], None] | None = None) -> None:
        self.prefix_cache = PrefixCache(cache_sink) if enable_prefix_caching else None
        self.kv = KVCacheManager(num_blocks, block_size, self.prefix_cache)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost = cost
        self.metrics = metrics
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.clock = clock
        self.finish_sink = finish_sink  # told of every finished request (--otlp-traces-endpoint: its span)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = EngineCounters()
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deadline = 0.0

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    # ---- requests --------------------------------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """Queue a request, or raise EngineBusy when admission control says no."""
        if self.max_num_queued_reqs is not None and len(self.waiting) >= self.max_num_queued_reqs:
            self._reject("max_num_queued_reqs")
        if self.max_num_queued_tokens is not None:
            backlog = sum(r.prefill_target - r.num_computed for r in self.waiting)
            if backlog + req.prompt_tokens > self.max_num_queued_tokens:
                self._reject("max_num_queued_tokens")
        req.status = "waiting"
        req.prefill_target = req.prompt_tokens
        self.waiting.append(req)
        self.counters.prompt_tokens += req.prompt_tokens
        self._work.set()

    def _reject(self, reason: str) -> None:
        self.counters.rejected += 1
        self.metrics.admission_rejections[reason].inc()
        raise EngineBusy(reason)

    def abort(self, req: SimRequest) -> None:
        """The client went away: free everything the request holds (counted as finished_reason=abort)."""
        if req.status in ("waiting", "running"):
            self._finish(req, "abort", self.clock())

    # ---- the loop --------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._work.clear()
                await self._work.wait()
            await self.step()

    async def step(self) -> None:
        """Schedule, wait the step's modelled time, then apply its results."""
        scheduled, prefill_tokens = self._schedule()
        duration = self.cost.step_seconds(len(scheduled), prefill_tokens)
        if duration > 0:
            now = self.clock()
            self._deadline = max(self._deadline, now - 0.002) + duration  # catch up on coarse timers, no debt
            await asyncio.sleep(max(0.0, self._deadline - now))
        else:
            await asyncio.sleep(0)
        self._apply(scheduled, self.clock())

    def step_now(self) -> int:
        """Schedule and apply one step at `clock()` without waiting: tests drive time through the clock.
        Returns how many requests the step scheduled."""
        scheduled, _ = self._schedule()
        self._apply(scheduled, self.clock())
        return len(scheduled)

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], int]:
        instant = self.cost.instant
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        prefill_tokens = 0
        now = self.clock()

        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining_prefill = req.prefill_target - req.num_computed
            if instant:
                n = remaining_prefill + max(0, req.output_tokens - req.num_output - 1)
            elif remaining_prefill > 0:
                n = min(remaining_prefill, budget)
            else:
                n = 1
            if n <= 0 or (not instant and budget <= 0):
                i += 1
                continue
            while not self.kv.allocate(req.blocks, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)  # the last admitted; it sits at or after i, so nothing scheduled is lost
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                if remaining_prefill > 0:
                    prefill_tokens += min(n, remaining_prefill)
                budget -= n
                i += 1

        while self.waiting and len(self.running) < self.max_num_seqs and (instant or budget > 0):
            req = self.waiting[0]
            first_time = req.scheduled_at is None
            cached = self.kv.find_cached(req.block_hashes, req.prefill_target) if req.num_computed == 0 else []
            hit_tokens = len(cached) * self.block_size
            remaining = req.prefill_target - hit_tokens
            if instant:
                n = remaining + max(0, req.output_tokens - req.num_output - 1)
            else:
                n = min(remaining, budget)
            if not self.kv.allocate(req.blocks, hit_tokens + n, cached):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = "running"
            req.num_computed = hit_tokens
            if first_time:
                req.scheduled_at = now
                req.cached_tokens = hit_tokens
                self.counters.cached_tokens += hit_tokens
                self.metrics.prefix_cache_queries.inc(req.prompt_tokens)
                self.metrics.prefix_cache_hits.inc(hit_tokens)
                self.metrics.prompt_tokens_cached_by_source["device"].inc(hit_tokens)
                self.metrics.queue_time.observe(now - req.arrival)
            scheduled.append((req, n))
            prefill_tokens += min(n, remaining)
            budget -= n
        return scheduled, prefill_tokens

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_registered_blocks = 0
        req.num_computed = 0
        req.prefill_target = req.prompt_tokens + req.num_output
        req.num_preemptions += 1
        req.status = "waiting"
        self.waiting.appendleft(req)
        self.counters.preemptions += 1
        self.metrics.num_preemptions.inc()

    def _apply(self, scheduled: list[tuple[SimRequest, int]], now: float) -> None:
        if not scheduled:
            return
        self.counters.steps += 1
        self.metrics.iteration_tokens.observe(sum(n for _, n in scheduled))
        for req, n in scheduled:
            if req.status != "running":  # aborted while the step ran
                continue
            in_prefill = req.num_computed < req.prefill_target
            req.num_computed += n
            if req.num_registered_blocks < len(req.block_hashes):
                full_prompt_blocks = min(len(req.block_hashes), min(req.num_computed, req.prompt_tokens)
                                         // self.block_size)
                self.kv.cache_blocks(req.blocks, req.block_hashes, req.num_registered_blocks, full_prompt_blocks)
                req.num_registered_blocks = max(req.num_registered_blocks, full_prompt_blocks)
            if in_prefill and req.num_computed < req.prefill_target:
                continue  # a chunk of a long prefill: no token yet
            new_tokens = req.output_tokens - req.num_output if self.cost.instant else 1
            self._emit(req, new_tokens, now)

    def _emit(self, req: SimRequest, new_tokens: int, now: float) -> None:
        m = self.metrics
        if req.first_token_at is None:
            req.first_token_at = now
            m.ttft.observe(now - req.arrival)
            m.prompt_tokens.inc(req.prompt_tokens)
            m.prompt_tokens_by_source["local_compute"].inc(req.prompt_tokens - req.cached_tokens)
            m.prompt_tokens_by_source["local_cache_hit"].inc(req.cached_tokens)
            m.prompt_tokens_cached.inc(req.cached_tokens)
        elif req.last_token_at is not None:
            m.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        req.num_output += new_tokens
        m.generation_tokens.inc(new_tokens)
        self.counters.generation_tokens += new_tokens
        if req.num_output >= req.output_tokens:
            self._finish(req, req.natural_finish, now)
        else:
            req.wake.set()

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        if req.status == "running":
            self.running.remove(req)
        elif req.status == "waiting":
            self.waiting.remove(req)
        self.kv.free(req.blocks)
        req.blocks = []
        req.status = "finished"
        req.finish_reason = reason
        req.finished_at = now
        m = self.metrics
        m.request_success[reason].inc()
        m.e2e.observe(now - req.arrival)
        m.request_num_preemptions.observe(req.num_preemptions)
        m.request_prefill_kv_computed_tokens.observe(req.prompt_tokens - req.cached_tokens)
        m.request_params_max_tokens.observe(req.max_tokens)
        group = req.group
        if group is None:
            m.request_max_num_generation_tokens.observe(req.num_output)
            m.request_params_n.observe(1)
        else:
            group.max_generation_tokens = max(group.max_generation_tokens, req.num_output)
            group.remaining -= 1
            if group.remaining == 0:
                m.request_max_num_generation_tokens.observe(group.max_generation_tokens)
                m.request_params_n.observe(group.n)
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.completed += 1
        if req.scheduled_at is not None and req.first_token_at is not None and req.last_token_at is not None:
            m.inference_time.observe(req.last_token_at - req.scheduled_at)
            m.prefill_time.observe(req.first_token_at - req.scheduled_at)
            decode = req.last_token_at - req.first_token_at
            m.decode_time.observe(decode)
            if req.num_output > 1:
                m.tpot.observe(decode / (req.num_output - 1))
            m.request_prompt_tokens.observe(req.prompt_tokens)
            m.request_generation_tokens.observe(req.num_output)
        if self.finish_sink is not None:
            self.finish_sink(req)
        req.wake.set()

    # ---- views -----------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Clear the prefix cache and counters (POST /sim/reset); requests in flight are untouched."""
        self.kv.reset_prefix_cache()
        self.counters = EngineCounters()

    def fits(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.kv.num_blocks
