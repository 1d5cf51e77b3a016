"""The demo's sample workload: a couple of requests a second of every kind the status page can show, sent by
`m3gate demo` to its own gateway over loopback HTTP, so that the page has something to show on first open.

    chat        short chats (most streamed)                       every ~0.7 s   → interactive pool
    reasoning   a streamed answer with thinking_mode enabled       every ~6 s     → interactive pool
    agent       a tool loop under one x-session-id: tool calls,    every ~15 s    → interactive pool, agent sessions
                tool pauses, then a think pause and a follow-up
    repository  a ~40K-token prompt                                every ~15 s    → repository pool
    document    a ~150K-token document                             every ~60 s    → extended pool
    batch       a Batch API job of BATCH_LINES short chats          every ~30 s    → the batch class, into headroom
                (/v1/files, then /v1/batches; the gateway runs it)

Every kind starts within the first few seconds. Bounded: at most MAX_IN_FLIGHT requests (an agent session counts as
one) at once, a kind whose turn comes while that bound is reached skips that turn; the long texts are built once.
The texts are words of three letters and a space, 4 bytes each: one token each for the simulators' tokenizer.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import httpx

log = logging.getLogger("m3gate.demo")

MAX_IN_FLIGHT = 6
REPOSITORY_TOKENS = 40_000  # above the 32K interactive pool, inside the 128K repository pool
DOCUMENT_TOKENS = 150_000  # above the 128K repository pool
BATCH_LINES = 4
SESSION_HEADER = "x-session-id"  # one of policies/sessions.py's SESSION_HEADERS (OpenCode's)
WORDS = ("the and for you not are but all any can her was one our out day get has him his how man new now old see "
         "two way who boy did its let put say she too use top set run own off end few far ask big air box car cat "
         "cut dog eye fun hot job law lot map mix net oil pay red sea sit sun ten toy van win yes").split()


@dataclass(frozen=True)
class Cadence:
    kind: str
    first_s: float  # when the kind first runs after the start
    every_s: float  # mean gap afterwards (±25% jitter)


CADENCES = (
    Cadence("chat", 0.0, 0.7),
    Cadence("reasoning", 1.0, 6.0),
    Cadence("agent", 1.5, 15.0),
    Cadence("repository", 2.5, 15.0),
    Cadence("document", 4.0, 60.0),
    Cadence("batch", 3.0, 30.0),
)
KINDS = tuple(c.kind for c in CADENCES)


def schedule(seed: int = 0, cadences: tuple[Cadence, ...] = CADENCES) -> Iterator[tuple[float, str]]:
    """(seconds after the start, kind), in time order, without end: each kind at its cadence, jittered."""
    rng = random.Random(seed)
    heap = [(c.first_s, i) for i, c in enumerate(cadences)]
    heapq.heapify(heap)
    while True:
        t, i = heapq.heappop(heap)
        yield t, cadences[i].kind
        heapq.heappush(heap, (t + cadences[i].every_s * rng.uniform(0.75, 1.25), i))


@lru_cache(maxsize=8)
def text(key: str, tokens: int) -> str:
    """`tokens` words of 4 bytes (" xyz"), the same for the same key (so repeated prompts share a cached prefix)."""
    rng = random.Random(key)
    return "".join(" " + rng.choice(WORDS) for _ in range(tokens))


TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite.",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def request_body(kind: str, n: int, model: str) -> dict[str, Any]:
    """The body of the `n`th single request of `kind` (chat, reasoning, repository, document)."""
    if kind == "chat":
        question = f"Question {n}:" + text(f"chat-{n % 50}", 30)
        body: dict[str, Any] = {"messages": [{"role": "user", "content": question}],
                                "max_tokens": 16 + 8 * (n % 5), "stream": n % 4 != 3}
    elif kind == "reasoning":
        body = {"messages": [{"role": "user", "content": "Think it through:" + text(f"reason-{n % 20}", 60)}],
                "max_tokens": 160, "stream": True, "chat_template_kwargs": {"thinking_mode": "enabled"}}
    elif kind == "repository":
        repository = "You review this repository:" + text("repo", REPOSITORY_TOKENS)
        body = {"messages": [{"role": "system", "content": repository},
                             {"role": "user", "content": f"Where is change {n} needed?"}],
                "max_tokens": 48, "stream": True}
    elif kind == "document":
        body = {"messages": [{"role": "user", "content": "Summarise this document:" + text("doc", DOCUMENT_TOKENS)
                              + f" (reading {n})"}],
                "max_tokens": 48, "stream": True}
    else:
        raise ValueError(f"no single request of kind {kind!r}")
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return {"model": model, **body}


class DemoTraffic:
    """Plays `schedule()` against a gateway until cancelled; `counts` says what was sent and how it went."""

    def __init__(self, base_url: str, model: str, *, seed: int = 0, max_in_flight: int = MAX_IN_FLIGHT,
                 tool_pause_s: float = 0.6, think_pause_s: float = 3.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.seed = seed
        self.max_in_flight = max_in_flight
        self.tool_pause_s = tool_pause_s
        self.think_pause_s = think_pause_s
        self.counts: Counter[str] = Counter()  # "<kind> sent|ok|failed|skipped"
        self.in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._reported: set[str] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        numbers: Counter[str] = Counter()
        limits = httpx.Limits(max_connections=self.max_in_flight + 2, max_keepalive_connections=self.max_in_flight)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120.0, limits=limits) as client:
            try:
                for at, kind in schedule(self.seed):
                    await asyncio.sleep(max(0.0, start + at - loop.time()))
                    if self.in_flight >= self.max_in_flight:
                        self.counts[f"{kind} skipped"] += 1
                        continue
                    numbers[kind] += 1
                    task = asyncio.ensure_future(self._one(client, kind, numbers[kind]))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            finally:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, kind: str, n: int) -> None:
        self.in_flight += 1
        try:
            if kind == "agent":
                await self._agent(client, n)
            elif kind == "batch":
                await self._batch(client, n)
            else:
                await self._send(client, kind, request_body(kind, n, self.model), {})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed sample request is counted, the demo goes on
            self._failed(kind, f"{type(e).__name__}: {e}")
        finally:
            self.in_flight -= 1

    async def _send(self, client: httpx.AsyncClient, kind: str, body: dict[str, Any],
                    headers: dict[str, str]) -> dict[str, Any] | None:
        """One request; a non-streamed answer's JSON (None when streamed or failed)."""
        self.counts[f"{kind} sent"] += 1
        if body.get("stream"):
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
                async for _ in resp.aiter_bytes():
                    pass
                status = resp.status_code
            answer = None
        else:
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            status = resp.status_code
            answer = resp.json() if status == 200 else None
        if status != 200:
            self._failed(kind, f"HTTP {status}")
            return None
        self.counts[f"{kind} ok"] += 1
        return answer

    async def _agent(self, client: httpx.AsyncClient, n: int) -> None:
        """A coding agent's task: two tool calls (each answered after a tool pause), a final answer, then the user
        thinks and asks a follow-up, all under one session id."""
        headers = {SESSION_HEADER: f"demo-agent-{self.seed}-{n}"}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent." + text("agent-system", 400)},
            {"role": "user", "content": f"Task {n}: fix the failing test."}]
        for step in range(3):
            body = {"model": self.model, "messages": messages, "tools": TOOLS, "max_tokens": 48,
                    "tool_choice": "required" if step < 2 else "none"}
            answer = await self._send(client, "agent", body, headers)
            if answer is None:
                return
            message = answer["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            messages.append({"role": "assistant", "content": message.get("content"),
                             **({"tool_calls": calls} if calls else {})})
            if not calls:
                break
            await asyncio.sleep(self.tool_pause_s)
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['function']['name']}:"
                          + text(f"tool-{step}", 80)} for c in calls]
        await asyncio.sleep(self.think_pause_s)
        messages.append({"role": "user", "content": "Thanks. Now add a test for it."})
        await self._send(client, "agent", {"model": self.model, "messages": messages, "max_tokens": 32,
                                           "stream": True, "stream_options": {"include_usage": True}}, headers)

    async def _batch(self, client: httpx.AsyncClient, n: int) -> None:
        """Upload BATCH_LINES short chats as a JSONL file and start a batch over it; the gateway runs it in the
        headroom the other classes leave (its progress shows on the status page)."""
        lines = [json.dumps({"custom_id": f"demo-{n}-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": self.model, "max_tokens": 24, "messages": [
                                 {"role": "user", "content": f"Batch {n} item {i}:" + text(f"batch-{i}", 40)}]}})
                 for i in range(BATCH_LINES)]
        self.counts["batch sent"] += 1
        upload = await client.post("/v1/files", data={"purpose": "batch"},
                                   files={"file": (f"demo-{n}.jsonl", ("\n".join(lines) + "\n").encode(),
                                                   "application/jsonl")})
        if upload.status_code != 200:
            self._failed("batch", f"upload: HTTP {upload.status_code}")
            return
        job = await client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                                                     "endpoint": "/v1/chat/completions",
                                                     "metadata": {"source": "m3gate demo"}})
        if job.status_code != 200:
            self._failed("batch", f"create: HTTP {job.status_code}")
            return
        self.counts["batch ok"] += 1

    def _failed(self, kind: str, why: str) -> None:
        self.counts[f"{kind} failed"] += 1
        if kind not in self._reported:  # one line per kind, not one per request
            self._reported.add(kind)
            log.warning("demo traffic: a %s request failed (%s); later failures are counted, not logged", kind, why)

    def summary(self) -> str:
        sent = sum(v for k, v in self.counts.items() if k.endswith(" sent"))
        failed = sum(v for k, v in self.counts.items() if k.endswith(" failed"))
        return f"{sent} sample requests sent, {failed} failed"
