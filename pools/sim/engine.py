"""The simulated engine: vLLM v1's scheduler loop over a paged KV cache, with modelled step times.

One asyncio task runs steps. A step schedules running requests first (a decode token each, or the next chunk of
their prefill), then admits waiting requests in FCFS order while the token budget (`max_num_batched_tokens`), the
batch size (`max_num_seqs`) and free KV blocks allow; a request that cannot get its blocks waits at the head of the
queue (vLLM's head-of-line behaviour). A running request that needs a new block when none is free preempts the
most recently admitted one, which loses its blocks and is recomputed later (prefix hits permitting).

The step then "runs" for the cost model's time (prefill ∝ uncached tokens, decode grows with the batch) and every
scheduled request advances: a finished prefill samples the first token, a decode samples the next. Handlers learn
of new tokens through the request's `wake` event; the engine never touches HTTP.

With a KV connector (prefill/decode disaggregation, `disagg.py`) two more paths exist, both vLLM's: a decode-side
request whose prompt KV lives on a prefill replica is admitted by allocating the whole prompt and parked out of the
batch ("loading", vLLM's WAITING_FOR_REMOTE_KVS) while the connector pulls it, then rejoins the queue's head with
all but its last prompt token computed; a prefill-side request that finishes hands its blocks to the connector,
which holds them until the decode side has read them or the lease expires.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class KVConnector(Protocol):
    """The engine's view of a KV-transfer connector (vLLM's KVConnectorBase_V1 scheduler side)."""

    def start_load(self, req: SimRequest, num_blocks: int) -> None:
        """Pull `num_blocks` (the prompt blocks not already cached here) for `req`; call Engine.finish_load after."""

    def request_finished(self, req: SimRequest, reason: str, now: float) -> tuple[bool, dict[str, Any] | None]:
        """(whether the connector now holds req.blocks and will free them itself, the response's
        kv_transfer_params)."""
        ...


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
    kv_transfer: dict[str, Any] | None = None  # kv_transfer_params, when a connector acts on them
    remote_prefill: bool = False  # decode side: the prompt's KV is to be pulled from a prefill replica
    reported_cached_tokens: int | None = None  # decode side: the prefill side's prefix hits, reported in usage
    # engine state
    status: str = "new"  # new | waiting | loading | running | finished | killed (engine gone while draining)
    blocks: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # prompt blocks already stored in the prefix cache
    num_computed: int = 0  # tokens whose KV is computed
    prefill_target: int = 0  # tokens to compute before the next token is sampled (prompt, + outputs after preemption)
    cached_tokens: int = 0  # prefix-cache hit when first scheduled (+ tokens pulled by KV transfer)
    external_tokens: int = 0  # prompt tokens whose KV came by KV transfer
    kv_loaded: bool = False  # the pull finished: all prompt tokens but the last are computed
    kv_transfer_out: dict[str, Any] | None = None  # the connector's kv_transfer_params for the response
    num_output: int = 0
    num_preemptions: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    trace_parent: tuple[int, int] | None = None  # (trace id, parent span id) of its traceparent (pools/sim/tracing.py)
    server_abort: bool = False  # aborted by the replica shutting down, not by its client

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def usage_cached_tokens(self) -> int:
        """usage.prompt_tokens_details.cached_tokens: vLLM's output processor reports the prefill side's
        `remote_prefill_cached_tokens` on the decode side, not its own ~100% hit from the transfer."""
        return self.cached_tokens if self.reported_cached_tokens is None else self.reported_cached_tokens


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
        self.loading: list[SimRequest] = []  # parked while the connector pulls their prompt's KV
        self.connector: KVConnector | None = None
        self.recompute_load_failures = False  # kv_load_failure_policy "recompute" (vLLM's default is "fail")
        self.counters = EngineCounters()
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deadline = 0.0
        self.draining = False  # SIGTERM received (vLLM's shutdown): the frontend refuses new requests

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
        if req.status in ("waiting", "loading", "running"):
            self._finish(req, "abort", self.clock())
        elif req.status == "killed":  # its engine is gone; only the client's hang-up ends the stream
            req.status, req.finish_reason = "finished", "abort"
            req.wake.set()

    def shutdown_abort(self, req: SimRequest) -> None:
        """The replica is shutting down (SIGTERM with --shutdown-timeout 0, or a request arriving while it
        drains): finish the request with "abort"; its stream still ends properly, its last chunk carrying the
        token of the step that was running (vLLM's abort output is the last delta: text and ids)."""
        if req.status in ("waiting", "loading", "running"):
            req.server_abort = True
            if req.status == "running" and 0 < req.num_output < req.output_tokens - 1:
                req.num_output += 1  # the step in flight: vLLM's abort output carries its token (the last delta)
            self._finish(req, "abort", self.clock())

    def kill(self, req: SimRequest) -> None:
        """The drain timed out and vLLM killed the engine process: the request makes no more progress and nothing
        tells its stream, which stays open and silent until the client hangs up."""
        if req.status == "running":
            self.running.remove(req)
        elif req.status == "waiting":
            self.waiting.remove(req)
        elif req.status == "loading":
            self.loading.remove(req)
        else:
            return
        self.kv.free(req.blocks)
        req.blocks = []
        req.status = "killed"

    @property
    def in_flight(self) -> list[SimRequest]:
        return [*self.waiting, *self.loading, *self.running]

    def release_blocks(self, blocks: list[int]) -> None:
        """The connector frees blocks it held for a decode side (they stay in the prefix cache, now evictable)."""
        self.kv.free(blocks)
        self._work.set()

    def finish_load(self, req: SimRequest, ok: bool) -> None:
        """The connector's pull ended. On success the prompt's blocks join the prefix cache and the request goes
        back to the queue's head with its last prompt token left to compute (vLLM recomputes it to sample); on
        failure it fails with finish_reason "error", or with the "recompute" policy starts over locally."""
        if req.status != "loading":
            return  # aborted meanwhile
        if not ok and not self.recompute_load_failures:
            self._finish(req, "error", self.clock())
            return
        self.loading.remove(req)
        if ok:
            full = min(len(req.block_hashes), req.prompt_tokens // self.block_size)
            self.kv.cache_blocks(req.blocks, req.block_hashes, 0, full)
            req.num_registered_blocks = full
            req.num_computed = req.prompt_tokens - 1
            req.kv_loaded = True
        else:
            self.kv.free(req.blocks)
            req.blocks = []
            req.num_computed = 0
            req.cached_tokens = req.external_tokens = 0
        req.status = "waiting"
        self.waiting.appendleft(req)
        self._work.set()

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
            if req.remote_prefill and self.connector is not None:
                if not self._start_load(req):
                    break
                continue
            first_time = req.scheduled_at is None
            if req.kv_loaded:
                cached, hit_tokens = [], req.num_computed
            else:
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
                if not req.kv_loaded:
                    req.cached_tokens = hit_tokens
                    self._count_lookup(req, hit_tokens)
                self.metrics.queue_time.observe(now - req.arrival)
            scheduled.append((req, n))
            prefill_tokens += min(n, remaining)
            budget -= n
        return scheduled, prefill_tokens

    def _count_lookup(self, req: SimRequest, hit_tokens: int) -> None:
        self.counters.cached_tokens += hit_tokens
        self.metrics.prefix_cache_queries.inc(req.prompt_tokens)
        self.metrics.prefix_cache_hits.inc(hit_tokens)
        self.metrics.prompt_tokens_cached_by_source["device"].inc(hit_tokens)

    def _start_load(self, req: SimRequest) -> bool:
        """vLLM's async KV load: allocate the whole prompt (adopting local prefix hits), park the request out of
        the batch and let the connector pull the blocks that were not hits. Uses no token budget and no batch
        slot. False when the blocks do not fit (the queue head then blocks, as any other)."""
        assert self.connector is not None
        cached = self.kv.find_cached(req.block_hashes, req.prompt_tokens)
        hit_tokens = len(cached) * self.block_size
        if not self.kv.allocate(req.blocks, req.prompt_tokens, cached):
            return False
        self.waiting.popleft()
        req.remote_prefill = False  # one transfer per request, as update_state_after_alloc does
        req.status = "loading"
        req.num_computed = req.prompt_tokens
        req.external_tokens = req.prompt_tokens - hit_tokens
        req.cached_tokens = req.prompt_tokens  # PrefillStats: local hits + external tokens
        self._count_lookup(req, hit_tokens)
        m = self.metrics
        m.external_prefix_cache_queries.inc(req.external_tokens)
        m.external_prefix_cache_hits.inc(req.external_tokens)
        m.prompt_tokens_cached_by_source["p2p"].inc(req.external_tokens)  # NixlConnector's cache-hit source
        self.loading.append(req)
        self.connector.start_load(req, len(req.blocks) - len(cached))
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_registered_blocks = 0
        req.num_computed = 0
        req.prefill_target = req.prompt_tokens + req.num_output
        req.num_preemptions += 1
        req.kv_loaded = False
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
            m.prompt_tokens_by_source["local_cache_hit"].inc(req.cached_tokens - req.external_tokens)
            m.prompt_tokens_by_source["external_kv_transfer"].inc(req.external_tokens)
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
        elif req.status == "loading":
            self.loading.remove(req)
        held = False
        if self.connector is not None and req.kv_transfer is not None:
            held, req.kv_transfer_out = self.connector.request_finished(req, reason, now)
        if not held:
            self.kv.free(req.blocks)
        req.blocks = []
        req.status = "finished"
        req.finish_reason = reason
        req.finished_at = now
        m = self.metrics
        m.request_success[reason].inc()
        m.e2e.observe(now - req.arrival)
        m.request_num_preemptions.observe(req.num_preemptions)
        m.request_prefill_kv_computed_tokens.observe(max(0, req.prompt_tokens - req.usage_cached_tokens))
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
