"""Helpers for the contract suite: SSE framing, Prometheus parsing, unique prompts, the local tokenizer oracle.

Expected values in the suite come from the vLLM 0.32 contract (shared/reference/vllm-contract.md, observed on a live
server) and from the tiny model's own tokenizer read here with the `tokenizers` library — never from the code of
the backend under test.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

SERVED_MODEL = "MiniMaxAI/MiniMax-M3"
BLOCK_SIZE = 128
VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class Backend:
    """One server the contract is checked against: `kind` is "sim" or "vllm"."""

    kind: str
    url: str
    max_model_len: int
    tokenizer_dir: Path


class LocalTokenizer:
    """The tiny model's tokenizer, loaded independently of either backend: the oracle for token ids."""

    def __init__(self, tokenizer_dir: Path):
        self._tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        self.bos_id = self._tok.token_to_id(config["bos_token"])
        self.eos_id = self._tok.token_to_id(config["eos_token"])

    def ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def strs(self, text: str) -> list[str]:
        return list(self._tok.encode(text, add_special_tokens=True).tokens)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def max_chars_per_token(self) -> int:
        """vLLM's bound for its character pre-check: the longest vocabulary entry."""
        return max(len(token) for token in self._tok.get_vocab(with_added_tokens=True))


def unique_words(n_words: int, *, seed: int | None = None) -> str:
    """Text no other test sent, so its prefix blocks cannot already be cached on a shared server."""
    rng = random.Random(seed if seed is not None else uuid.uuid4().int)
    vocabulary = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()
    return f"[{uuid.uuid4().hex}] " + " ".join(rng.choice(vocabulary) for _ in range(n_words))


def random_token_ids(n: int, *, low: int = 3, high: int = 1000) -> list[int]:
    """A prompt given as token ids (no tokenizer involved), unique per call."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(low, high) for _ in range(n)]


def expected_cached(prompt_tokens: int, shared_prefix: int | None = None) -> int:
    """vLLM reuses whole blocks only, and never the prompt's last token (it must be computed to sample)."""
    reusable = prompt_tokens - 1 if shared_prefix is None else min(shared_prefix, prompt_tokens - 1)
    return (reusable // BLOCK_SIZE) * BLOCK_SIZE


def expected_created(prompt_tokens: int, cached_tokens: int) -> int:
    """Chat's `created_cache_tokens`: the prompt's full blocks now in the cache, less those that were hits."""
    return (prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE - cached_tokens


# ---------------------------------------------------------------------------------------------------------------
# SSE


@dataclass
class SseStream:
    status: int
    content_type: str
    events: list[str]  # the payload of each `data: ` event, in order, "[DONE]" included

    def chunks(self) -> list[dict[str, Any]]:
        """Every JSON event; the stream must end with exactly one [DONE]."""
        assert self.events and self.events[-1] == "[DONE]", f"stream does not end with [DONE]: {self.events[-3:]}"
        assert self.events.count("[DONE]") == 1
        return [json.loads(event) for event in self.events[:-1]]


def parse_sse(body: str) -> list[str]:
    """Strict framing: every event is one `data: <payload>` line followed by a blank line (keep-alives skipped)."""
    assert body.endswith("\n\n"), f"stream does not end with a blank line: {body[-80:]!r}"
    payloads = []
    for event in body[:-2].split("\n\n"):
        if event.startswith(":"):
            continue
        assert "\n" not in event, f"multi-line SSE event: {event[:200]!r}"
        assert event.startswith("data: "), f"event without 'data: ': {event[:200]!r}"
        payloads.append(event[len("data: ") :])
    return payloads


async def post_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> SseStream:
    async with client.stream("POST", path, json=body) as response:
        raw = (await response.aread()).decode()
    return SseStream(response.status_code, response.headers.get("content-type", ""), parse_sse(raw))


# ---------------------------------------------------------------------------------------------------------------
# Prometheus


@dataclass
class MetricFamily:
    name: str  # without the `_total` suffix for counters, as the exposition parser reports it
    type: str
    samples: list[tuple[str, dict[str, str], float]]


async def scrape(client: httpx.AsyncClient) -> dict[str, MetricFamily]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = MetricFamily(
            family.name, family.type, [(s.name, dict(s.labels), float(s.value)) for s in family.samples]
        )
    return families


def sample_value(families: dict[str, MetricFamily], sample_name: str, **labels: str) -> float:
    """Sum of the samples called `sample_name` whose labels include `labels` (0 when none)."""
    family_name = sample_name
    for suffix in ("_total", "_count", "_sum", "_bucket"):
        if sample_name.endswith(suffix) and sample_name.removesuffix(suffix) in families:
            family_name = sample_name.removesuffix(suffix)
            break
    family = families.get(family_name)
    if family is None:
        return 0.0
    return sum(v for n, lab, v in family.samples if n == sample_name and labels.items() <= lab.items())


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout: float = 5.0) -> bool:
    """Metrics are published a moment after the response: poll instead of sleeping a fixed time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if await check():
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.1)
