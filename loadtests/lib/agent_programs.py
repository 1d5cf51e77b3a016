"""Agent programs replayed against a gateway: sessions with realistic shapes, scaled so that a 2-core machine can
drive hundreds of them at once (loadtests/bench/agents.py).

A session works on one of a few repositories: its first prompt is that repository's shared context plus its own
start (20K–60K tokens together), and every turn adds the previous answer and a tool result, so the context grows
toward 200K tokens over 5–40 turns; answers are short with a long tail (lognormal); the agent waits for its tools
between turns. A few heavy sessions keep several requests in flight (sub-agents under one session id).

Scaled: one prompt token on the simulator stands for `TOKEN_SCALE` real ones (the replicas' prefill cost per token
is multiplied by it, so a turn's prefill takes as long as the real one), and every delay (the replicas' steps, the
tool waits) is divided by the run's speed factor. Text is `loadtests.lib.textgen`'s: 4 bytes = 1 token.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtests.lib.client import Result, _send
from loadtests.lib.textgen import text, text_uncached
from loadtests.lib.workload import Item

MODEL = "MiniMaxAI/MiniMax-M3"
TOKEN_SCALE = 20  # real prompt tokens per simulated one
REPOSITORIES = 4
REPOSITORY_TOKENS = 16_000  # real: the shared part of a repository's context
START_TOKENS = (4_000, 44_000)  # real: the session's own start on top of it (20K–60K in all)
MAX_CONTEXT = 200_000  # real: a context stops growing here (the agent compacts its tool results)
TOOL_RESULT = (2_000.0, 1.0, 200, 20_000)  # real tokens per tool result: lognormal median, sigma, min, max
OUTPUT = (40.0, 1.1, 8, 1_200)  # output tokens per answer: lognormal median, sigma, min, max (not scaled)
TOOL_WAIT_S = (4.0, 0.5, 40.0)  # real seconds: exponential mean, min, max (divided by the speed)
HEAVY_EVERY = 20  # one session in this many is heavy
HEAVY_LANES = 4  # requests a heavy session keeps in flight
PREFILL_US_PER_TOKEN = 60.0 * TOKEN_SCALE  # the replicas' prefill cost per simulated token (60 µs per real one)
DECODE_MS_PER_TOKEN = 12.0 / 8  # a 12 ms step shared by a batch of 8: the decode cost of one answer token


@dataclass(frozen=True)
class Turn:
    tool_result: int  # simulated tokens of the tool result sent with this turn (0 on the first)
    output: int  # tokens asked for (ignore_eos: exactly this many)
    wait_s: float  # real seconds of tool wait before this turn (0 on the first)


@dataclass(frozen=True)
class SessionPlan:
    """One session as planned, equal in every run of a benchmark (a function of the seed and its number)."""

    number: int
    repository: int
    start: int  # simulated tokens of the session's own start
    lanes: tuple[tuple[Turn, ...], ...]  # one sequence of turns per request it keeps in flight

    @property
    def heavy(self) -> bool:
        return len(self.lanes) > 1

    @property
    def work_s(self) -> float:
        """Replica seconds it needs at speed 1 (its prompts prefilled once, its answers decoded in a batch of 8): how
        long it is, whatever the ordering."""
        prefill = sum(self.start + REPOSITORY_TOKENS // TOKEN_SCALE
                      + sum(t.tool_result + _answer_tokens(t.output) for t in lane) for lane in self.lanes)
        decode = sum(t.output for lane in self.lanes for t in lane)
        return prefill * PREFILL_US_PER_TOKEN / 1e6 + decode * DECODE_MS_PER_TOKEN / 1e3

    @property
    def requests(self) -> int:
        return sum(len(lane) for lane in self.lanes)


def _answer_tokens(output: int) -> int:
    """Simulated tokens of an answer of `output` real tokens, sent back in the next turn's history."""
    return max(1, output // TOKEN_SCALE)


def _lognormal(rnd: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, rnd.lognormvariate(math.log(median), sigma)))


def plan_sessions(count: int, seed: int, turns: tuple[int, int] = (5, 40)) -> list[SessionPlan]:
    """`count` sessions: turns drawn log-uniformly in `turns` (many short sessions, a few long ones), one in
    HEAVY_EVERY heavy (HEAVY_LANES lanes), contexts capped at MAX_CONTEXT."""
    rnd = random.Random(seed)
    out = []
    for n in range(count):
        repository = rnd.randrange(REPOSITORIES)
        start = rnd.randint(*START_TOKENS)
        lanes = HEAVY_LANES if n % HEAVY_EVERY == HEAVY_EVERY // 2 else 1
        lo, hi = turns
        count_turns = int(round(math.exp(rnd.uniform(math.log(lo), math.log(hi)))))
        built = []
        for _ in range(lanes):
            context = REPOSITORY_TOKENS + start
            lane = []
            for k in range(count_turns):
                output = int(_lognormal(rnd, *OUTPUT))
                if k == 0:
                    lane.append(Turn(0, output, 0.0))
                    continue
                result = int(_lognormal(rnd, *TOOL_RESULT))
                result = max(0, min(result, MAX_CONTEXT - context))
                context += result + output
                mean, low, high = TOOL_WAIT_S
                lane.append(Turn(result // TOKEN_SCALE, output, min(high, max(low, rnd.expovariate(1 / mean)))))
            built.append(tuple(lane))
        out.append(SessionPlan(n, repository, start // TOKEN_SCALE, tuple(built)))
    return out


@dataclass
class SessionRun:
    """What one session did in one run: its requests' results (`loadtests.lib.client.Result`), times from the run's
    start."""

    plan: SessionPlan
    started: float = 0.0
    ended: float | None = None
    results: list[Result] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.ended is None or any(not r.ok for r in self.results)

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


def _opening(plan: SessionPlan, lane: int) -> list[dict[str, Any]]:
    repository = text(f"agents/repository/{plan.repository}", REPOSITORY_TOKENS // TOKEN_SCALE)
    own = text_uncached(f"agents/{plan.number}/{lane}/start", plan.start)
    return [{"role": "system", "content": repository}, {"role": "user", "content": own}]


async def _lane(http: aiohttp.ClientSession, url: str, run: SessionRun, lane: int, t0: float, speed: float,
                class_headers: dict[str, str]) -> bool:
    """One lane's turns, in order: the answer, the tool wait, the next turn with the answer and the tool result."""
    plan = run.plan
    messages = _opening(plan, lane)
    headers = {"content-type": "application/json", "x-session-id": f"agents-{plan.number}", **class_headers}
    for k, turn in enumerate(plan.lanes[lane]):
        if k:
            await asyncio.sleep(turn.wait_s / speed)
            messages.append({"role": "user", "content": text_uncached(f"agents/{plan.number}/{lane}/{k}",
                                                                      turn.tool_result)})
        body = {"model": MODEL, "messages": messages, "max_tokens": turn.output, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
                "chat_template_kwargs": {"thinking_mode": "disabled"}}
        item = Item(index=plan.number * 1000 + lane * 100 + k, cls="agents", api="chat", body=body,
                    session=f"agents-{plan.number}", turn=k)
        result = Result(item, time.perf_counter() - t0)
        run.results.append(result)
        await _send(http, url + "/v1/chat/completions", item, orjson.dumps(body), result, headers, None)
        if not result.ok:
            return False
        # the answer as the next turn's history: synthetic text of its size (the simulator caches prompts only)
        messages.append({"role": "assistant", "content": text_uncached(f"agents/{plan.number}/{lane}/a{k}",
                                                                       _answer_tokens(turn.output))})
    return True


async def run_session(http: aiohttp.ClientSession, url: str, run: SessionRun, t0: float, speed: float,
                      class_headers: dict[str, str] | None = None) -> None:
    run.started = time.perf_counter() - t0
    done = await asyncio.gather(*(_lane(http, url, run, lane, t0, speed, class_headers or {})
                                  for lane in range(len(run.plan.lanes))))
    if all(done):
        run.ended = time.perf_counter() - t0


@dataclass
class Population:
    """A run of sessions at a fixed concurrency: `slots` sessions at once, each slot taking the next planned session
    when its own ends. `full_until`: when the last planned session started (till then every slot was busy)."""

    runs: list[SessionRun]
    full_until: float
    elapsed: float


async def run_population(url: str, plans: list[SessionPlan], slots: int, speed: float, ramp_s: float,
                         timeout_s: float = 900.0) -> Population:
    """The sessions of `plans` in order, `slots` at once; the first `slots` start spread over `ramp_s` (the same
    offsets in every run)."""
    runs = [SessionRun(p) for p in plans]
    pending = list(reversed(runs))
    full_until = 0.0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as http:
        async def slot(k: int) -> None:
            nonlocal full_until
            await asyncio.sleep(ramp_s * k / max(1, slots))
            while pending:
                run = pending.pop()
                if not pending:
                    full_until = time.perf_counter() - t0
                await run_session(http, url, run, t0, speed)

        await asyncio.gather(*(slot(k) for k in range(slots)))
    elapsed = time.perf_counter() - t0
    return Population(runs, full_until or elapsed, elapsed)
