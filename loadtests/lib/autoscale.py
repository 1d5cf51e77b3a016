"""The machinery of `python -m loadtests.bench.autoscale`: a compressed day of traffic, an actuator that adds and
removes simulated replicas by editing a gateway's pool file, and the autoscaling policies compared.

- `Day`: phases of a 24-hour day (night, ramp ×4 up, peak, a burst, a long-context wave, ramp down, evening) over
  the interactive and repository classes, each hour `hour_s` seconds long, turned into the requests a run sends.
- `Actuator`: one policy's pool. `scale_to(n)` starts simulated replicas (`m3gate sim`) at once but writes them into
  the pool file (which the gateway hot-reloads, gateway/reload.py) only `startup_s` after they were asked for, as a
  MiniMax-M3 replica is useless until its weights are loaded; replicas removed leave the file first (the gateway
  drains them) and stop a little later. It bills replica-seconds from the ask to the removal.
- `Hpa`: what a HorizontalPodAutoscaler does with a recommendation (scale-up limited per period, scale-down to the
  highest recommendation within the stabilization window), behind each threshold rule and m3gate's signal.
- The policies: `M3gateSignal` (follows `GET /admin/capacity`'s desired count through the HPA of
  deploy/k8s/autoscaling-hpa), `KedaWaiting` (production-stack: `vllm:num_requests_waiting` AverageValue 5, poll
  15 s, cooldown 360 s), `Saturation` (llm-d's workload-variant-autoscaler: KV 0.8 / queue 5 saturation, spare
  triggers 0.1 / 3, ±1 per 60 s cycle on the 1-minute peaks, HPA stabilization 240 s), and `Fixed`.

Every control-loop time (start-up, stabilization windows, poll periods, the signal's window and interval) is
multiplied by one factor, `Timescale.control`, so that their ratios to each other stay those of a deployment.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.lib.textgen import text, text_uncached
from loadtests.lib.workload import Item, arrival_times

MODEL = "MiniMaxAI/MiniMax-M3"
POOL = "chat"
CLASS_HEADER = "x-m3gate-class"
CLASSES = ("interactive", "repository")

# The simulated replica: a step costs 15 ms + 0.3 ms per sequence + 0.3 ms per prefilled token (a replica 5× slower
# than the simulator's H200 default, so that a few requests a second fill several replicas on a 2-core machine),
# chunked prefill of 2,048 tokens, 512 KV blocks of 128 tokens (so the long-context wave fills the KV cache).
SIM_ARGS = ("--prefill-us-per-token", "300", "--decode-ms-per-step", "15", "--decode-ms-per-seq", "0.3",
            "--max-num-batched-tokens", "2048", "--kv-blocks", "512", "--max-num-seqs", "64")
KV_BLOCKS, BLOCK_SIZE = 512, 128
TARGETS = {"interactive": {"ttft_ms": {"p95": 1500}, "tpot_ms": {"p95": 100}},
           "repository": {"ttft_ms": {"p95": 10000}, "tpot_ms": {"p95": 200}}}


# ---------------------------------------------------------------------------------------------------------------
# The day


@dataclass(frozen=True)
class Shape:
    """One class's requests: prompt and output tokens, a shared prefix from `groups` groups."""

    prompt: tuple[int, int]  # uniform, tokens (prefix included)
    output: int
    prefix_tokens: int = 0
    groups: int = 0


INTERACTIVE = Shape((600, 1800), 24, prefix_tokens=400, groups=8)
REPOSITORY = Shape((4000, 8000), 48, prefix_tokens=2000, groups=4)
LONG = Shape((10000, 14000), 48)


@dataclass(frozen=True)
class Phase:
    name: str
    hours: float
    interactive: tuple[float, float]  # rate multiplier at the phase's start and end (a ramp when they differ)
    repository: tuple[float, float]
    long_rate: float = 0.0  # long-context repository requests per second, besides the repository shape
    constant: bool = False  # constant load: the signal should not move


DAY = (
    Phase("night", 7, (1, 1), (1, 1), constant=True),
    Phase("ramp up", 2, (1, 4), (1, 4)),
    Phase("peak", 1, (4, 4), (4, 4)),
    Phase("burst", 0.5, (8, 8), (4, 4)),
    Phase("peak 2", 1.5, (4, 4), (4, 4)),
    Phase("long-context wave", 2, (4, 4), (4, 4), long_rate=0.15),
    Phase("afternoon", 3, (4, 4), (4, 4), constant=True),
    Phase("ramp down", 3, (4, 1), (4, 1)),
    Phase("evening", 4, (1, 1), (1, 1)),
)
BASE_RATE = {"interactive": 1.2, "repository": 0.15}  # requests/s at multiplier 1


@dataclass(frozen=True)
class Timescale:
    """`hour_s`: seconds of run per hour of the day; `control`: seconds of run per second of a control loop (0.05:
    a 180 s start-up takes 9 s, a 300 s stabilization window 15 s, ten minutes 30 s)."""

    hour_s: float = 15.0
    control: float = 0.05
    window_s: float = 20.0  # the signal's demand window: a measurement, sized by the requests it holds (below)

    def s(self, seconds: float) -> float:
        return seconds * self.control


@dataclass
class Day:
    phases: Sequence[Phase]
    scale: Timescale
    seed: int = 0

    def bounds(self) -> list[tuple[Phase, float, float]]:
        """(phase, start, end) in seconds from the run's start."""
        out, t = [], 0.0
        for p in self.phases:
            out.append((p, t, t + p.hours * self.scale.hour_s))
            t += p.hours * self.scale.hour_s
        return out

    @property
    def duration_s(self) -> float:
        return sum(p.hours for p in self.phases) * self.scale.hour_s

    def phase_at(self, t: float) -> str:
        for p, start, end in self.bounds():
            if start <= t < end:
                return p.name
        return self.phases[-1].name

    def items(self) -> dict[str, list[Item]]:
        """The requests of the day per class, seeded: every policy gets the same ones at the same offsets."""
        rnd = random.Random(self.seed)
        out: dict[str, list[Item]] = {c: [] for c in CLASSES}
        for p, start, end in self.bounds():
            span = end - start
            for cls, mult in (("interactive", p.interactive), ("repository", p.repository)):
                r0, r1 = BASE_RATE[cls] * mult[0], BASE_RATE[cls] * mult[1]
                shape = INTERACTIVE if cls == "interactive" else REPOSITORY
                self._add(out[cls], cls, shape, _arrival(r0, r1, span), rnd, start, span)
            if p.long_rate > 0:
                self._add(out["repository"], "repository", LONG, {"process": "poisson", "rate": p.long_rate}, rnd,
                          start, span)
        for cls in out:
            out[cls].sort(key=lambda i: i.at)
        return out

    def _add(self, items: list[Item], cls: str, shape: Shape, arrival: dict[str, Any], rnd: random.Random,
             start: float, span: float) -> None:
        for t in arrival_times(arrival, rnd, duration_s=span):
            if t >= span:
                continue
            idx = len(items)
            prompt = rnd.randint(*shape.prompt)
            messages = []
            prefix = 0
            if shape.groups:
                group = rnd.randrange(shape.groups)
                system = text(f"{self.seed}/{cls}/prefix/{group}", shape.prefix_tokens)
                messages.append({"role": "system", "content": system.strip()})
                prefix = shape.prefix_tokens
            unique = text_uncached(f"{self.seed}/{cls}/{start:.3f}/{idx}/{rnd.random()}", max(1, prompt - prefix))
            messages.append({"role": "user", "content": unique.strip()})
            body = {"model": MODEL, "messages": messages, "max_tokens": shape.output, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            items.append(Item(index=idx, cls=cls, api="chat", body=body, at=start + t, prompt_tokens_est=prompt,
                              output_tokens=shape.output, prefix_tokens=prefix))


def _arrival(r0: float, r1: float, span: float) -> dict[str, Any]:
    if abs(r0 - r1) < 1e-9:
        return {"process": "poisson", "rate": r0}
    return {"process": "ramp", "start_rate": r0, "end_rate": r1, "ramp_s": span}


# ---------------------------------------------------------------------------------------------------------------
# The gateway's config and the actuator


def gateway_config(endpoints: Sequence[str], scale: Timescale, max_replicas: int) -> dict[str, Any]:
    """The bench pool: one pool serving both classes (their class from the x-m3gate-class header), the classes'
    targets, and the capacity signal's times scaled by `scale.control`."""
    classes = {
        "interactive": {"priority": 0, "max_concurrency": 256, "queue_length": 512, "max_queue_wait_s": 30,
                        "targets": TARGETS["interactive"]},
        "repository": {"priority": 1, "max_concurrency": 64, "queue_length": 256, "max_queue_wait_s": 60,
                       "targets": TARGETS["repository"]},
    }
    return {
        "model": MODEL,
        "pools": [{"name": POOL, "max_model_len": 32768, "kv_blocks": KV_BLOCKS, "block_size": BLOCK_SIZE,
                   "endpoints": list(endpoints), "capacity": {"min_replicas": 1, "max_replicas": max_replicas}}],
        "server": {"health_interval_s": 1.0},
        "traffic": {"classes": classes, "pool_classes": {POOL: "interactive"}},
        "capacity": {"interval_s": max(0.2, scale.s(5.0)), "window_s": scale.window_s,
                     "scale_down_stabilization_s": scale.s(300.0), "startup_s": scale.s(180.0)},
    }


@dataclass
class Replica:
    asked_at: float
    ready_at: float
    sim: Any = None  # pools.sim.launcher.SimProcess once started
    joined_at: float | None = None
    removed_at: float | None = None
    failed: str | None = None


@dataclass
class ScaleEvent:
    at: float
    before: int
    after: int
    reason: str


class Actuator:
    """One policy's replicas. `scale_to(n)` is an autoscaler setting a Deployment's replicas: new ones start now and
    join the pool file `startup_s` later; surplus ones (those still starting first, then the newest) leave it."""

    def __init__(self, name: str, config: dict[str, Any], pool_file: Path | None, startup_s: float,
                 clock: Callable[[], float], sim_args: Sequence[str] = SIM_ARGS,
                 start_sim: Callable[..., Any] | None = None) -> None:
        from pools.sim.launcher import start_sim as default_start

        self.name = name
        self.config = config
        self.pool_file = pool_file
        self.startup_s = startup_s
        self.clock = clock
        self.sim_args = list(sim_args)
        self._start_sim = start_sim or default_start
        self.replicas: list[Replica] = []
        self.events: list[ScaleEvent] = []
        self.samples: list[tuple[float, int, int]] = []  # (t, in the pool, asked for)
        self._stopping: list[asyncio.Task[None]] = []
        self.spares: list[Any] = []
        self._restocking: list[asyncio.Task[None]] = []

    # counts
    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.removed_at is None and r.failed is None]

    @property
    def ready(self) -> list[Replica]:
        return [r for r in self.live if r.joined_at is not None]

    @property
    def target(self) -> int:
        return len(self.live)

    def urls(self) -> list[str]:
        return [r.sim.url for r in self.ready]

    async def start_now(self, n: int, spares: int = 0) -> None:
        """`n` replicas ready at once (the run's initial pool: started before the clock runs), and `spares` processes
        kept started but out of the pool, so that a replica asked for later is ready `startup_s` after the ask
        rather than whenever a busy machine gets a new Python process going (not billed until asked for)."""
        sims = await asyncio.gather(*(asyncio.to_thread(self._spawn) for _ in range(n + spares)))
        now = self.clock()
        for sim in sims[:n]:
            self.replicas.append(Replica(now, now, sim, joined_at=now))
        self.spares = list(sims[n:])

    def _spawn(self) -> Any:
        return self._start_sim(32768, extra_args=self.sim_args)

    async def _fresh(self) -> Any:
        """A started replica with an empty cache: a spare (reset; another spare is started behind it) or a new one."""
        if self.spares:
            sim = self.spares.pop()
            self._restocking.append(asyncio.get_running_loop().create_task(self._restock()))
            await asyncio.to_thread(sim.reset)
            return sim
        return await asyncio.to_thread(self._spawn)

    async def _restock(self) -> None:
        try:
            self.spares.append(await asyncio.to_thread(self._spawn))
        except Exception:  # noqa: BLE001 - no spare: the next ask starts a process itself
            pass

    async def scale_to(self, n: int, reason: str) -> None:
        n = max(1, n)
        before = self.target
        if n == before:
            return
        now = self.clock()
        self.events.append(ScaleEvent(now, before, n, reason))
        if n > before:
            for _ in range(n - before):
                replica = Replica(now, now + self.startup_s)
                self.replicas.append(replica)
                asyncio.get_running_loop().create_task(self._boot(replica))
            return
        surplus = before - n
        starting = sorted((r for r in self.live if r.joined_at is None), key=lambda r: -r.asked_at)
        serving = sorted(self.ready, key=lambda r: -r.asked_at)
        for r in (starting + serving)[:surplus]:
            r.removed_at = now
            self._stopping.append(asyncio.get_running_loop().create_task(self._retire(r)))
        self.write()

    async def _boot(self, replica: Replica) -> None:
        try:
            replica.sim = await self._fresh()
        except Exception as exc:  # noqa: BLE001 - a replica that did not start is reported, not fatal
            replica.failed = str(exc)[:200]
            return
        if replica.removed_at is not None:
            await asyncio.to_thread(replica.sim.stop)

    async def _retire(self, replica: Replica, drain_s: float = 5.0) -> None:
        """Out of the pool file now (the gateway drains it); the process stops once its streams had time to end."""
        await asyncio.sleep(drain_s if replica.joined_at is not None else 0.0)
        while replica.sim is None and replica.failed is None and self.clock() - replica.asked_at < 120:
            await asyncio.sleep(0.5)
        if replica.sim is not None:
            await asyncio.to_thread(replica.sim.stop)

    def tick(self) -> None:
        """Replicas whose start-up delay has passed (and whose process answers) join the pool file."""
        now = self.clock()
        joined = False
        for r in self.live:
            if r.joined_at is None and r.sim is not None and now >= r.ready_at:
                r.joined_at = now
                joined = True
        if joined:
            self.write()
        self.samples.append((now, len(self.ready), self.target))

    def write(self) -> None:
        """The pool file with the replicas that serve now, replaced atomically (the gateway reloads on change)."""
        if self.pool_file is None:
            return
        self.config["pools"][0]["endpoints"] = self.urls()
        tmp = self.pool_file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.config, sort_keys=False))
        os.replace(tmp, self.pool_file)

    def replica_seconds(self, start: float, end: float) -> float:
        """Replica-seconds billed within [start, end]: from each ask (start-up included) to its removal."""
        total = 0.0
        for r in self.replicas:
            if r.failed is None:
                until = min(end, r.removed_at if r.removed_at is not None else end)
                total += max(0.0, until - max(start, r.asked_at))
        return total

    async def close(self) -> None:
        await asyncio.gather(*self._restocking, return_exceptions=True)  # a process being started is stopped too
        for sim in self.spares:
            await asyncio.to_thread(sim.stop)
        self.spares = []
        for r in self.replicas:
            if r.removed_at is None:
                r.removed_at = self.clock()
        for task in self._stopping:
            task.cancel()
        for r in self.replicas:
            while r.sim is None and r.failed is None and self.clock() - r.asked_at < 60:
                await asyncio.sleep(0.2)
            if r.sim is not None:
                await asyncio.to_thread(r.sim.stop)


# ---------------------------------------------------------------------------------------------------------------
# The HPA and the policies


@dataclass
class Hpa:
    """A HorizontalPodAutoscaler's behaviour (autoscaling/v2): scale up at most `up_percent` % or `up_pods` pods
    (the larger) per `up_period_s`; scale down only to the highest recommendation of the last `down_window_s`."""

    down_window_s: float
    up_period_s: float
    up_percent: float = 100.0
    up_pods: int = 4
    history: deque[tuple[float, int]] = field(default_factory=deque)
    _period: tuple[float, int] | None = None

    def apply(self, now: float, current: int, recommended: int, low: int, high: int) -> int:
        rec = max(low, min(high, recommended))
        self.history.append((now, rec))
        while self.history and self.history[0][0] < now - self.down_window_s:
            self.history.popleft()
        if rec > current:
            if self._period is None or now - self._period[0] >= self.up_period_s:
                self._period = (now, current)
            base = self._period[1]
            limit = max(math.ceil(base * (1 + self.up_percent / 100.0)), base + self.up_pods)
            return max(current, min(rec, limit))
        if rec < current:
            return min(current, max(n for _, n in self.history))
        return current


class Policy:
    """An autoscaler: every `period_s`, `recommend()` the replicas, through its HPA, onto the actuator."""

    name = "policy"

    def __init__(self, actuator: Actuator, period_s: float, hpa: Hpa | None, low: int, high: int) -> None:
        self.actuator = actuator
        self.period_s = period_s
        self.hpa = hpa
        self.low, self.high = low, high

    async def recommend(self, http: aiohttp.ClientSession) -> int | None:
        raise NotImplementedError

    async def observe(self, http: aiohttp.ClientSession) -> None:
        """Called every second (metrics a rule keeps a window of)."""

    async def step(self, http: aiohttp.ClientSession) -> None:
        rec = await self.recommend(http)
        if rec is None:
            return
        current = self.actuator.target
        n = self.hpa.apply(self.actuator.clock(), current, rec, self.low, self.high) if self.hpa else rec
        await self.actuator.scale_to(n, f"{self.name}: recommended {rec}")


class Fixed(Policy):
    name = "fixed"

    async def recommend(self, http: aiohttp.ClientSession) -> int | None:
        return None


class M3gateSignal(Policy):
    """m3gate_pool_desired_replicas, read from GET /admin/capacity (the same figure), through the HPA of
    deploy/k8s/autoscaling-hpa (sync 15 s; up 100 % per 60 s; down stabilization 60 s)."""

    name = "m3gate"

    def __init__(self, actuator: Actuator, gateway_url: str, scale: Timescale, low: int, high: int) -> None:
        super().__init__(actuator, scale.s(15.0), Hpa(scale.s(60.0), scale.s(60.0), 100.0, 0), low, high)
        self.url = gateway_url
        self.entries: list[tuple[float, dict[str, Any]]] = []  # (t, /admin/capacity's entry)

    async def _entry(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        try:
            async with http.get(self.url + "/admin/capacity") as resp:
                body = await resp.json()
            return body["pools"][POOL]["both"]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
            return None

    async def observe(self, http: aiohttp.ClientSession) -> None:
        entry = await self._entry(http)
        if entry is not None:
            self.entries.append((self.actuator.clock(), entry))

    async def recommend(self, http: aiohttp.ClientSession) -> int | None:
        entry = await self._entry(http)
        return None if entry is None or entry.get("desired") is None else int(entry["desired"])


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """vllm:num_requests_waiting and vllm:kv_cache_usage_perc of one replica (None when it does not answer)."""
    try:
        async with http.get(url + "/metrics") as resp:
            body = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    out = {"waiting": 0.0, "kv": 0.0}
    for line in body.splitlines():
        if line.startswith("vllm:num_requests_waiting{") or line.startswith("vllm:num_requests_waiting "):
            out["waiting"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:kv_cache_usage_perc"):
            out["kv"] = max(out["kv"], float(line.rsplit(" ", 1)[1]))
    return out


class KedaWaiting(Policy):
    """vLLM production-stack's KEDA ScaledObject: a Prometheus trigger on vllm:num_requests_waiting, threshold 5
    (AverageValue: replicas = ceil(sum / 5), the HPA's 10 % tolerance), polling 15 s, cooldown 360 s (the
    scale-down stabilization), the HPA's default scale-up (100 % or 4 pods per 15 s)."""

    name = "keda"
    THRESHOLD = 5.0

    def __init__(self, actuator: Actuator, scale: Timescale, low: int, high: int) -> None:
        super().__init__(actuator, scale.s(15.0), Hpa(scale.s(360.0), scale.s(15.0)), low, high)

    async def recommend(self, http: aiohttp.ClientSession) -> int | None:
        seen = await asyncio.gather(*(scrape(http, u) for u in self.actuator.urls()))
        total = sum(s["waiting"] for s in seen if s is not None)
        current = self.actuator.target
        ratio = total / (self.THRESHOLD * current) if current else math.inf
        if abs(ratio - 1.0) <= 0.1:
            return current
        return math.ceil(total / self.THRESHOLD)


class Saturation(Policy):
    """llm-d's workload-variant-autoscaler, saturation mode: per ready replica the peak (max over 60 s) KV usage
    and queue; non-saturated ones are those under 0.8 and 5; scale up by one when their average spare KV < 0.1 or
    spare queue < 3 (or none is left), down by one when the load of N−1 still leaves both spares; a cycle every
    60 s; desired held while replicas are pending; HPA scale-down stabilization 240 s."""

    name = "llm-d"
    KV, QUEUE, KV_SPARE, QUEUE_SPARE = 0.8, 5.0, 0.1, 3.0

    def __init__(self, actuator: Actuator, scale: Timescale, low: int, high: int) -> None:
        super().__init__(actuator, scale.s(60.0), Hpa(scale.s(240.0), scale.s(15.0)), low, high)
        self.window_s = scale.s(60.0)
        self.seen: dict[str, deque[tuple[float, float, float]]] = {}

    async def observe(self, http: aiohttp.ClientSession) -> None:
        urls = self.actuator.urls()
        now = self.actuator.clock()
        for url, s in zip(urls, await asyncio.gather(*(scrape(http, u) for u in urls))):
            if s is not None:
                q = self.seen.setdefault(url, deque())
                q.append((now, s["kv"], s["waiting"]))
                while q and q[0][0] < now - self.window_s:
                    q.popleft()

    async def recommend(self, http: aiohttp.ClientSession) -> int | None:
        peaks = [(max(k for _, k, _ in q), max(w for _, _, w in q)) for u, q in self.seen.items()
                 if q and u in self.actuator.urls()]
        ready = len(peaks)
        if ready == 0 or ready < self.actuator.target:  # replicas pending: the desired count stands
            return None
        return ready + saturation_step(peaks, self.KV, self.QUEUE, self.KV_SPARE, self.QUEUE_SPARE)


def saturation_step(peaks: Sequence[tuple[float, float]], kv_max: float, queue_max: float, kv_spare: float,
                    queue_spare: float) -> int:
    """+1, −1 or 0 from the replicas' (KV usage, waiting) peaks, as the WVA saturation analyzer decides."""
    free = [(k, q) for k, q in peaks if k < kv_max and q < queue_max]
    if not free:
        return 1
    spare_kv = sum(kv_max - k for k, _ in free) / len(free)
    spare_q = sum(queue_max - q for _, q in free) / len(free)
    if spare_kv < kv_spare or spare_q < queue_spare:
        return 1
    if len(free) >= 2:
        rest = len(free) - 1
        if (kv_max - sum(k for k, _ in free) / rest >= kv_spare
                and queue_max - sum(q for _, q in free) / rest >= queue_spare):
            return -1
    return 0


async def control_loop(policy: Policy, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
    """The actuator's tick and the policy's observations every `tick_s`, its decision every `period_s`."""
    tick_s = min(1.0, policy.period_s)
    next_decision = policy.actuator.clock() + policy.period_s
    while not stop.is_set():
        policy.actuator.tick()
        await policy.observe(http)
        if policy.actuator.clock() >= next_decision:
            next_decision += policy.period_s
            await policy.step(http)
        try:
            await asyncio.wait_for(stop.wait(), tick_s)
        except asyncio.TimeoutError:
            pass


def monotonic() -> float:
    return time.monotonic()
