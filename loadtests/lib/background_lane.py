"""The background lane measured (loadtests/bench/agents.py): a background class saturating a pool with long greedy
streams, foreground bursts beside it, and every background answer checked against its uninterrupted one.

Phases, on one gateway in front of a simulated pool:
1. references: each background prompt on every replica at once, straight to them (nothing can pause them): its greedy
   answer (the same on every replica), and the pool's capacity (every sequence slot decoding);
2. idle: the foreground bursts alone (their TTFT is the reference);
3. loaded: background workers keep more long streams than the pool runs at once; once the lane holds every sequence
   slot (or a minute passed), the same bursts, at the same offsets; then the workers stop and every stream started
   runs to its end (paused ones are resumed when the bursts are gone).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from loadtests.lib.replicas import SimPool, gateway, gateway_config, wait_gateway_sees
from loadtests.lib.results import Results
from loadtests.lib.textgen import text

MODEL = "MiniMaxAI/MiniMax-M3"
BACKGROUND = {"x-m3gate-class": "bulk"}
PROMPTS = 8  # distinct background prompts, cycled by the workers
FG_TOKENS = 1000  # a foreground burst's prompt, unique per request
FG_OUTPUT = 32
BURST_SPREAD_S = 1.0  # a burst's requests arrive over this long (the same offsets in both phases)
GOAL_FG_P95 = 1.5  # × the idle pool's
GOAL_BG_SHARE = 0.8  # of the capacity the foreground leaves


@dataclass
class Stream:
    """One streamed answer as the client saw it: text, the events that make it whole, when each token came."""

    prompt: int = -1
    content: str = ""
    finishes: list[str] = field(default_factory=list)
    errors: int = 0
    done: int = 0
    completion_tokens: int | None = None
    status: int = 0
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter of each content chunk


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                      out: Stream) -> Stream:
    """POST a streamed chat and put its events together (SSE comments, such as `: paused`, are not the answer)."""
    sent = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        out.status = resp.status
        if resp.status != 200:
            await resp.read()
            out.errors += 1
            return out
        buf = b""
        async for piece in resp.content.iter_any():
            now = time.perf_counter()
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                data = event[6:]
                if data == b"[DONE]":
                    out.done += 1
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out.errors += 1
                    continue
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if out.ttft is None:
                        out.ttft = now - sent
                    piece_text = (choice.get("delta") or {}).get("content") or ""
                    if piece_text:
                        out.content += piece_text
                        out.token_times.append(now)
                    if choice.get("finish_reason"):
                        out.finishes.append(choice["finish_reason"])
    return out


def background_body(prompt: int, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "temperature": 0, "ignore_eos": True, "max_tokens": tokens,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"thinking_mode": "disabled"},
            "messages": [{"role": "user", "content": text(f"agents/background/{prompt}", 300)}]}


def foreground_body(burst: int, n: int, phase: str) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "max_tokens": FG_OUTPUT, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"thinking_mode": "disabled"},
            "messages": [{"role": "user", "content": text(f"agents/foreground/{phase}/{burst}/{n}", FG_TOKENS)}]}


def lane_config(urls: list[str], slots: int) -> dict[str, Any]:
    """Foreground `interactive` and background `bulk`; a replica with one request waiting in its own queue is
    saturated (the lane's gate, and what pauses background streams when foreground requests wait)."""
    return gateway_config(urls, extra={"server": {"health_interval_s": 0.1}, "traffic": {
        "pool_classes": {"bench": "interactive"}, "saturation": {"max_waiting": 1},
        "classes": {
            "interactive": {"priority": 0, "max_concurrency": 4 * slots, "queue_length": 256,
                            "max_queue_wait_s": 60, "ttft_target_s": 1.0},
            "bulk": {"priority": 9, "background": True, "max_concurrency": slots, "queue_length": 1024,
                     "max_queue_wait_s": 600, "max_pauses": 3, "pause_keepalive_s": 1.0}}}})


@dataclass
class BackgroundRun:
    """The scenario's measurements and checks."""

    bursts: int
    burst_size: int
    gap_s: float
    bg_tokens: int
    idle_ttft: list[float] = field(default_factory=list)
    loaded_ttft: list[float] = field(default_factory=list)
    fg_failed: int = 0
    capacity_tok_s: float = 0.0  # every sequence slot decoding, streams straight to the replicas
    references_agree: bool = False  # each prompt's answer the same on every replica
    lane_full: bool = False  # the lane held every slot before the bursts
    lane_tok_s: float = 0.0  # its rate then
    bg_tok_s: float = 0.0
    fg_tok_s: float = 0.0
    answers: int = 0
    whole: int = 0
    equal: int = 0
    pauses: float = 0.0
    window_min: float | None = None

    @property
    def fg_p95_ratio(self) -> float | None:
        idle, loaded = _p95(self.idle_ttft), _p95(self.loaded_ttft)
        return loaded / idle if idle and loaded is not None and not self.fg_failed else None

    @property
    def left_tok_s(self) -> float:
        return max(0.0, self.capacity_tok_s - self.fg_tok_s)

    @property
    def bg_share(self) -> float | None:
        return self.bg_tok_s / self.left_tok_s if self.left_tok_s else None

    def as_dict(self) -> dict[str, Any]:
        return {"bursts": self.bursts, "burst_size": self.burst_size, "gap_s": self.gap_s,
                "bg_tokens": self.bg_tokens, "idle_ttft_p95_s": _p95(self.idle_ttft),
                "loaded_ttft_p95_s": _p95(self.loaded_ttft), "fg_failed": self.fg_failed,
                "fg_p95_ratio": self.fg_p95_ratio, "capacity_tok_s": self.capacity_tok_s,
                "references_agree": self.references_agree, "lane_full": self.lane_full, "lane_tok_s": self.lane_tok_s,
                "bg_tok_s": self.bg_tok_s, "fg_tok_s": self.fg_tok_s, "left_tok_s": self.left_tok_s,
                "bg_share": self.bg_share, "answers": self.answers, "whole": self.whole, "equal": self.equal,
                "pauses": self.pauses, "window_min": self.window_min}

    def markdown(self) -> list[str]:
        d = self.as_dict()
        return ["| figure | value |", "|---|---|",
                f"| foreground TTFT p95, idle pool | {_f(d['idle_ttft_p95_s'])} s |",
                f"| foreground TTFT p95, beside the background | {_f(d['loaded_ttft_p95_s'])} s "
                f"({_f(d['fg_p95_ratio'])}×; {self.fg_failed} failed) |",
                f"| pool capacity (every slot decoding, straight to the replicas) | {self.capacity_tok_s:.0f} tok/s |",
                f"| the lane alone before the bursts ({'every slot' if self.lane_full else 'NOT every slot'}) | "
                f"{self.lane_tok_s:.0f} tok/s |",
                f"| foreground during the bursts | {self.fg_tok_s:.0f} tok/s |",
                f"| background during the bursts | {self.bg_tok_s:.0f} tok/s ({_f(d['bg_share'])} of the "
                f"{self.left_tok_s:.0f} tok/s left) |",
                f"| background answers whole / equal to their uninterrupted answer | {self.whole} / {self.equal} "
                f"of {self.answers} ({self.pauses:.0f} pauses) |"]

    def figures(self, out: Results) -> None:
        out.add("background: foreground TTFT p95, idle pool", _p95(self.idle_ttft), "s")
        out.add("background: foreground TTFT p95 ÷ the idle pool's", self.fg_p95_ratio, "×", at_most=GOAL_FG_P95,
                reference="same bursts, idle pool", reference_value=_p95(self.idle_ttft))
        out.add("background: background output ÷ the capacity the foreground leaves", self.bg_share, "×",
                at_least=GOAL_BG_SHARE, reference="capacity − foreground tok/s", reference_value=self.left_tok_s)
        out.add("background: answers whole and equal to the uninterrupted greedy answer", self.equal, "answers",
                goal=f"all {self.answers}", passed=self.answers > 0 and self.equal == self.whole == self.answers
                and self.references_agree,
                reference="answers", reference_value=self.answers)
        out.add("background: streams paused", self.pauses, "pauses")


def _p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def _f(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _lane(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/admin/traffic", timeout=5) as resp:
        return json.loads(resp.read())["pools"].get("bench", {}).get("background", {}).get("bulk", {})


def _pauses(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('m3gate_stream_pauses_total{class="bulk",pool="bench"}'):
                return float(line.split()[-1])
    return 0.0


def _rate(streams: list[Stream], start: float, end: float) -> float:
    return sum(1 for s in streams for t in s.token_times if start <= t < end) / (end - start)


async def _bursts(http: aiohttp.ClientSession, url: str, run: BackgroundRun, phase: str,
                  out: list[Stream]) -> tuple[float, float]:
    """The bursts at their offsets, each request at its own offset within BURST_SPREAD_S; returns the window they
    cover (first burst → one gap after the last)."""
    rnd = random.Random(11)
    offsets = sorted((b * run.gap_s + rnd.uniform(0, BURST_SPREAD_S), b, n)
                     for b in range(run.bursts) for n in range(run.burst_size))
    start = time.perf_counter()
    tasks = []
    for at, b, n in offsets:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        s = Stream()
        out.append(s)
        tasks.append(asyncio.create_task(stream_chat(http, url, foreground_body(b, n, phase), {}, s)))
    await asyncio.gather(*tasks)
    end = start + run.bursts * run.gap_s
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    return start, end


async def _scenario(pool: SimPool, url: str, run: BackgroundRun, workers: int, slots: int) -> list[Stream]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        # every prompt on every replica at once, `slots` streams straight to the replicas: the answers nothing can
        # pause, and the pool's capacity (all its sequence slots decoding)
        refs = [Stream(prompt=k % PROMPTS) for k in range(slots)]
        await asyncio.gather(*(stream_chat(http, pool.urls[k % len(pool.urls)],
                                           background_body(s.prompt, run.bg_tokens), {}, s)
                               for k, s in enumerate(refs)))
        times = sorted(t for s in refs for t in s.token_times)
        run.capacity_tok_s = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        reference = {s.prompt: s.content for s in refs}
        run.references_agree = all(s.content == reference[s.prompt] for s in refs)
        idle: list[Stream] = []
        await _bursts(http, url, run, "idle", idle)
        run.idle_ttft = [s.ttft for s in idle if s.ttft is not None]
        pool.reset()  # the loaded bursts find no cache the idle ones left
        before = _pauses(url)
        background: list[Stream] = []
        stop = asyncio.Event()
        rnd = random.Random(7)

        async def worker() -> None:
            while not stop.is_set():
                s = Stream(prompt=rnd.randrange(PROMPTS))
                background.append(s)
                await stream_chat(http, url, background_body(s.prompt, run.bg_tokens), BACKGROUND, s)

        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline and _lane(url).get("in_flight", 0) < slots:
            await asyncio.sleep(0.2)
        run.lane_full = _lane(url).get("in_flight", 0) >= slots
        t = time.perf_counter()
        await asyncio.sleep(run.gap_s)
        run.lane_tok_s = _rate(background, t, time.perf_counter())
        loaded: list[Stream] = []
        windows: list[float] = []

        async def watch() -> None:
            while not stop.is_set():
                windows.append(_lane(url).get("window", 0))
                await asyncio.sleep(0.25)

        watcher = asyncio.create_task(watch())
        start, end = await _bursts(http, url, run, "loaded", loaded)
        stop.set()
        await asyncio.gather(*tasks, watcher)
        run.loaded_ttft = [s.ttft for s in loaded if s.ttft is not None]
        run.fg_failed = sum(1 for s in loaded + idle if s.ttft is None or s.errors)
        run.fg_tok_s = _rate(loaded, start, end)
        run.bg_tok_s = _rate(background, start, end)
        run.window_min = min(windows, default=None)
        run.pauses = _pauses(url) - before
        run.answers = len(background)
        whole = [s for s in background if s.status == 200 and not s.errors and s.done == 1
                 and s.finishes == ["length"] and s.completion_tokens == run.bg_tokens]
        run.whole = len(whole)
        run.equal = sum(1 for s in whole if s.content == reference[s.prompt])
        return background


def run_background(pool: SimPool, slots: int, quick: bool, bg_tokens: int = 200) -> BackgroundRun:
    """The scenario on `pool` (its replicas run `slots` sequences in all), through a fresh gateway."""
    run = BackgroundRun(bursts=3 if quick else 6, burst_size=12, gap_s=3.0, bg_tokens=bg_tokens)
    with gateway(lane_config(pool.urls, slots)) as gw:
        wait_gateway_sees(gw.url, len(pool.urls))
        asyncio.run(_scenario(pool, gw.url, run, workers=slots + 8, slots=slots))
    return run
