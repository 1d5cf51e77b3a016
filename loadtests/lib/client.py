"""The load generator: asyncio + aiohttp, open loop, OpenAI-compatible streaming requests.

Independent requests are sent at their planned offsets whether or not earlier ones have finished (open loop, as
`vllm bench serve` with a request rate). Agent sessions start at their planned offsets too; inside a session a turn
follows the previous answer after its think/tool time, as a real agent does. Issuing stops at `duration_s` or
`max_requests`; whatever is still running at `duration_s + drain_s` is cancelled and counted as `deadline`.
`max_concurrency` caps requests in flight (vLLM's `--max-concurrency`; with all arrivals at 0 it is a closed loop of
that many workers, what the overhead benchmark uses).

Timing follows `vllm bench serve` (vllm-contract.md §9): TTFT is the time to the first `data:` event with a
non-empty `choices` (for chat, the role chunk), ITL the gaps between successive such events, E2EL the last such
event minus the send time, output tokens from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtests.lib.workload import Item, Plan

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class Result:
    """What happened to one request (times in seconds; `t_send` from the run's start)."""

    __slots__ = ("index", "cls", "session", "turn", "stream", "t_send", "ttft", "e2el", "itl", "prompt_tokens",
                 "output_tokens", "cached_tokens", "status", "error", "replica", "chunks", "prefix_group")

    def __init__(self, item: Item, t_send: float) -> None:
        self.index = item.index
        self.cls = item.cls
        self.session = item.session
        self.turn = item.turn
        self.stream = item.stream
        self.prefix_group = item.prefix_group
        self.t_send = t_send
        self.ttft: float | None = None
        self.e2el: float | None = None
        self.itl: list[float] = []
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.status = 0
        self.error: str | None = None
        self.replica: str | None = None
        self.chunks = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "itl"}
        d["itl_count"] = len(self.itl)
        return d


class Target:
    """Where requests go: a gateway URL, or replicas round-robined by the client (the cache-blind baseline)."""

    def __init__(self, gateway: str | None = None, replicas: Sequence[str] = ()) -> None:
        if (gateway is None) == (not replicas):
            raise ValueError("give a gateway URL or replica URLs, not both")
        self.gateway = gateway.rstrip("/") if gateway else None
        if self.gateway and self.gateway.endswith("/v1"):
            self.gateway = self.gateway[:-3]
        self.replicas = [r.rstrip("/") for r in replicas]
        self._turn = itertools.count()

    @property
    def label(self) -> str:
        return f"gateway {self.gateway}" if self.gateway else f"direct ({len(self.replicas)} replicas, round robin)"

    def pick(self) -> str:
        if self.gateway:
            return self.gateway
        return self.replicas[next(self._turn) % len(self.replicas)]


@dataclass
class RunOutput:
    results: list[Result]
    started_wall: float  # time.time() at the start
    duration_s: float  # first send → last completion
    planned: int
    not_sent: int
    target: str
    extra: dict[str, Any] = field(default_factory=dict)


def _error_code(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        code = err.get("code") or err.get("type")
        return f":{code}" if code else ""
    return ""


class _Progress:
    def __init__(self, total: int, enabled: bool | None, desc: str) -> None:
        self.bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, desc=desc, unit="req", dynamic_ncols=True, leave=False)
        self.errors = 0
        self._last = 0.0

    def done(self, result: Result) -> None:
        if self.bar is None:
            return
        if result.error:
            self.errors += 1
        self.bar.update(1)
        now = time.monotonic()
        if now - self._last > 0.5:
            self._last = now
            self.bar.set_postfix(errors=self.errors, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _send(http: aiohttp.ClientSession, url: str, item: Item, payload: bytes, result: Result,
                headers: dict[str, str], default_replica: str | None) -> None:
    clock = time.perf_counter
    st = clock()
    try:
        async with http.post(url, data=payload, headers=headers) as resp:
            result.status = resp.status
            result.replica = resp.headers.get("x-m3gate-endpoint") or default_replica
            if resp.status != 200:
                body = await resp.read()
                result.error = f"http_{resp.status}{_error_code(body)}"
                result.e2el = clock() - st
                return
            if not item.stream:
                body = await resp.read()
                now = clock()
                result.ttft = result.e2el = now - st
                try:
                    usage = orjson.loads(body).get("usage") or {}
                except (orjson.JSONDecodeError, AttributeError):
                    usage = {}
                _take_usage(result, usage)
                result.chunks = 1
                return
            buf = b""
            last = 0.0
            done = False
            itl = result.itl
            async for chunk in resp.content.iter_any():
                now = clock()
                buf = buf + chunk if buf else chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                events, buf = buf[:cut].split(b"\n\n"), buf[cut + 2:]
                for event in events:
                    at = event.find(b"data:")
                    if at < 0:
                        continue
                    data = event[at + 5:].strip()
                    if data == b"[DONE]":
                        done = True
                    elif b'"choices":[{' in data:
                        if result.ttft is None:
                            result.ttft = now - st
                        else:
                            itl.append(now - last)
                        last = now
                        result.chunks += 1
                        if b'"usage"' in data:
                            _take_usage_json(result, data)
                    elif b'"usage"' in data:
                        _take_usage_json(result, data)
                    elif b'"error"' in data:
                        result.error = "stream_error" + _error_code(data)
            if result.ttft is not None:
                result.e2el = last - st
            else:
                result.e2el = clock() - st
            if result.output_tokens is None:
                result.output_tokens = result.chunks
            if not done and result.error is None:
                result.error = "incomplete_stream"
    except asyncio.CancelledError:
        result.error = "deadline"
        result.e2el = clock() - st
        raise
    except asyncio.TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientConnectorError:
        result.error = "connect_error"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError):
        result.error = "disconnected"
    except aiohttp.ClientError as exc:
        result.error = f"client_error:{type(exc).__name__}"
    except OSError as exc:
        result.error = f"os_error:{exc.errno}"
    if result.error and result.e2el is None:
        result.e2el = clock() - st


def _take_usage_json(result: Result, data: bytes) -> None:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
        _take_usage(result, obj["usage"])


def _take_usage(result: Result, usage: dict[str, Any]) -> None:
    if not usage:
        return
    result.prompt_tokens = usage.get("prompt_tokens")
    result.output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is not None:
        result.cached_tokens = int(cached)


async def run_plan(plan: Plan, target: Target, *, duration_s: float | None = None, max_requests: int | None = None,
                   max_concurrency: int | None = None, drain_s: float | None = None, timeout_s: float | None = None,
                   progress: bool | None = None, headers: dict[str, str] | None = None, run_id: str = "lt",
                   on_result: Callable[[Result], None] | None = None) -> RunOutput:
    """Send the plan to the target; return every request's result (see the module docstring)."""
    duration_s = plan.duration_s if duration_s is None else duration_s
    max_requests = plan.max_requests if max_requests is None else max_requests
    drain_s = plan.drain_s if drain_s is None else drain_s
    timeout_s = plan.timeout_s if timeout_s is None else timeout_s
    issue_until = duration_s if duration_s is not None else float("inf")
    budget = max_requests if max_requests is not None else len(plan.items)
    planned = min(budget, len(plan.items))

    # events: (time, order, kind, payload) — "one" = an independent request, "session" = a session's turns
    starts: list[tuple[float, int, str, Any]] = []
    for n, item in enumerate(plan.independent()):
        starts.append((item.at, n, "one", item))
    for n, (sid, turns) in enumerate(plan.sessions().items()):
        starts.append((turns[0].at, len(starts) + n, "session", turns))
    heapq.heapify(starts)

    results: list[Result] = []
    issued = 0
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    prog = _Progress(planned, progress, plan.name)
    base_headers = {"content-type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
    clock = time.perf_counter
    tasks: set[asyncio.Task[None]] = set()
    t0 = clock()
    started_wall = time.time()
    last_end = [t0]

    def may_issue() -> bool:
        return issued < budget and clock() - t0 <= issue_until

    async def one(http: aiohttp.ClientSession, item: Item) -> Result:
        nonlocal issued
        if sem is not None:
            await sem.acquire()
        try:
            issued_now = clock()
            result = Result(item, issued_now - t0)
            results.append(result)
            url_base = target.pick()
            url = url_base + API_PATHS[item.api]
            h = dict(base_headers)
            h["x-request-id"] = f"{run_id}-{item.index}"
            await _send(http, url, item, orjson.dumps(item.body), result, h,
                        None if target.gateway else url_base)
            return result
        finally:
            if sem is not None:
                sem.release()
            end = clock()
            if end > last_end[0]:
                last_end[0] = end

    async def single(http: aiohttp.ClientSession, item: Item) -> None:
        result = await one(http, item)
        prog.done(result)
        if on_result:
            on_result(result)

    async def session(http: aiohttp.ClientSession, turns: list[Item]) -> None:
        nonlocal issued
        prev_send = clock()
        for k, item in enumerate(turns):
            if k:
                if item.pacing == "interval":
                    wake = prev_send + item.wait_s
                else:
                    wake = clock() + item.wait_s
                delay = wake - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not may_issue():
                    return
                issued += 1
            prev_send = clock()
            result = await one(http, item)
            prog.done(result)
            if on_result:
                on_result(result)
            if result.error:
                return  # an agent whose call failed does not go on with a history it never got

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     skip_auto_headers=("User-Agent",)) as http:
        try:
            while starts:
                at, _, kind, payload = heapq.heappop(starts)
                delay = t0 + at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not may_issue():
                    break
                issued += 1
                coro = single(http, payload) if kind == "one" else session(http, payload)
                task = asyncio.ensure_future(coro)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if duration_s is not None:
                hard = issue_until + drain_s
            else:  # bounded by count: allow the longest request time after the last issue
                hard = clock() - t0 + max(drain_s, timeout_s)
            while tasks:
                remaining = t0 + hard - clock()
                if remaining <= 0:
                    break
                await asyncio.wait(set(tasks), timeout=remaining)
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            prog.close()
    sent = len(results)
    first = min((r.t_send for r in results), default=0.0)
    return RunOutput(results=results, started_wall=started_wall, duration_s=max(1e-9, last_end[0] - t0 - first),
                     planned=planned, not_sent=max(0, planned - sent), target=target.label)


def tpot_of(r: Result) -> float | None:
    if r.ttft is None or r.e2el is None or not r.output_tokens or r.output_tokens <= 1:
        return None
    return (r.e2el - r.ttft) / (r.output_tokens - 1)
