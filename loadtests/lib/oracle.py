"""Token structure of a plan, computed exactly as the simulated replicas see it, and the oracle hit rates.

Each request is rendered with the simulator's own chat template and 4-byte tokenizer (pools.sim.tokenizer) and cut
into chained hashes of full KV blocks (pools.sim.prefix_cache.block_hashes), so "blocks a replica could reuse" here
means exactly what it means to a replica's prefix cache: the longest run of leading full blocks already computed,
minus the last prompt token, which is always recomputed (kv.find_cached).

- **session oracle**: every session (else prefix group, else the request alone) on a replica of its own with an
  infinite cache; a request hits what earlier requests of its session computed. This is the target of the policy
  benchmark: perfect session affinity, no capacity limits.
- **global oracle**: one infinite cache sees every request in send order; the upper bound any routing can reach
  (it also counts system prompts shared across sessions).

Hit rates are token-weighted (hit tokens / prompt tokens), as vLLM's prefix_cache_hits / prefix_cache_queries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pools.sim.prefix_cache import block_hashes
from pools.sim.tokenizer import ByteChunkTokenizer, normalize_messages, placeholder_text

from loadtests.lib.workload import Item, Plan

_TOK = ByteChunkTokenizer()


def render_prompt(item: Item, image_tokens: int = 256) -> str:
    body = item.body
    if item.api == "completions":
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    chat = normalize_messages(body.get("messages") or [], placeholder=lambda m: placeholder_text(m, image_tokens))
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    kwargs = dict(body.get("chat_template_kwargs") or {})
    return _TOK.render_chat(chat.messages, tools=tools, add_generation_prompt=True, continue_final_message=False,
                            template_kwargs=kwargs)


def prompt_block_hashes(item: Item, block_size: int = 128, image_tokens: int = 256) -> list[int]:
    tokens = _TOK.encode(render_prompt(item, image_tokens), add_special_tokens=False)
    return block_hashes(tokens, block_size, item.body.get("cache_salt"))


def prompt_token_count(item: Item, image_tokens: int = 256) -> int:
    return _TOK.encode(render_prompt(item, image_tokens), add_special_tokens=False).count


@dataclass
class TokenStructure:
    """Per request: prompt tokens and full-block hashes (in plan order)."""

    index: list[int]
    key: list[str]
    tokens: list[int]
    hashes: list[list[int]]
    order: list[int]  # positions in an approximate send order


def token_structure(plan: Plan, block_size: int = 128, image_tokens: int = 256) -> TokenStructure:
    items = plan.items
    keys = []
    tokens = []
    hashes = []
    for item in items:
        keys.append(item.session or item.prefix_group or f"req{item.index}")
        t = _TOK.encode(render_prompt(item, image_tokens), add_special_tokens=False)
        tokens.append(t.count)
        hashes.append(block_hashes(t, block_size, item.body.get("cache_salt")))
    # approximate send order: start time plus the waits of earlier turns (answers take time too, but ordering
    # between sessions only matters to the global oracle, and only slightly)
    when: list[float] = []
    elapsed: dict[str, float] = {}
    for item in items:
        if item.session is None:
            when.append(item.at)
        else:
            t = elapsed.get(item.session, item.at) + (item.wait_s if item.turn else 0.0)
            elapsed[item.session] = t + 0.5
            when.append(t)
    order = sorted(range(len(items)), key=lambda k: (when[k], items[k].turn))
    return TokenStructure([i.index for i in items], keys, tokens, hashes, order)


def _hits(hashes: list[int], tokens: int, cached: set[int], block_size: int) -> int:
    limit = (tokens - 1) // block_size
    n = 0
    for h in hashes[:limit]:
        if h not in cached:
            break
        n += 1
    return n * block_size


def oracle_hit_rates(plan: Plan, block_size: int = 128, image_tokens: int = 256,
                     structure: TokenStructure | None = None,
                     sent: Iterable[int] | None = None) -> dict[str, Any]:
    """{"session": rate, "global": rate, "prompt_tokens": N, per-class rates}. `sent` limits the computation to the
    requests (plan indexes) a run really sent, so a run cut short by its duration is compared fairly."""
    s = structure or token_structure(plan, block_size, image_tokens)
    allowed = None if sent is None else set(sent)
    per_key: dict[str, set[int]] = {}
    everything: set[int] = set()
    total = hit_session = hit_global = 0
    by_class: dict[str, list[int]] = {}
    classes = [i.cls for i in plan.items]
    for k in s.order:
        if allowed is not None and s.index[k] not in allowed:
            continue
        hs, n = s.hashes[k], s.tokens[k]
        cache = per_key.setdefault(s.key[k], set())
        hs_hit = _hits(hs, n, cache, block_size)
        hg_hit = _hits(hs, n, everything, block_size)
        cache.update(hs)
        everything.update(hs)
        total += n
        hit_session += hs_hit
        hit_global += hg_hit
        acc = by_class.setdefault(classes[k], [0, 0, 0])
        acc[0] += n
        acc[1] += hs_hit
        acc[2] += hg_hit
    return {
        "prompt_tokens": total,
        "session": hit_session / total if total else 0.0,
        "global": hit_global / total if total else 0.0,
        "by_class": {c: {"prompt_tokens": a[0], "session": a[1] / a[0] if a[0] else 0.0,
                         "global": a[2] / a[0] if a[0] else 0.0} for c, a in by_class.items()},
    }


def trace_records(items: Iterable[Item], sent_at: Mapping[int, float] | None = None,
                  block_tokens: int = 128) -> list[dict[str, Any]]:
    """Replayable trace records in Mooncake's format (timestamp in ms, input/output lengths, `hash_ids`: one id
    per `block_tokens` block of the prompt as the simulator tokenizes it, equal ids = equal prefix), plus the
    fields Mooncake lacks (class, session, thinking, tool call, images). Timestamps are the actual send times when
    known, else the planned ones."""
    ids: dict[int, int] = {}
    out = []
    for item in items:
        hashes = prompt_block_hashes(item, block_tokens)
        rec: dict[str, Any] = {
            "timestamp": round(1000 * (sent_at or {}).get(item.index, item.at), 3),
            "input_length": prompt_token_count(item), "output_length": item.output_tokens,
            "hash_ids": [ids.setdefault(h, len(ids)) for h in hashes] + [len(ids) + item.index + 10**7],
            "block_tokens": block_tokens, "class": item.cls, "api": item.api}
        if item.prefix_group is not None:
            rec["prefix_group"] = item.prefix_group
        if item.session is not None:
            rec["session"] = item.session
            rec["turn"] = item.turn
        if item.thinking:
            rec["thinking"] = True
        if item.tool_call:
            rec["tool_call"] = True
        if item.images:
            rec["images"] = item.images
        out.append(rec)
    return out
