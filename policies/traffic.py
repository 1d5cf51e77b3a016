"""Traffic classes and input limits: which class a request belongs to, the priority it carries, which pools its API
key lets it use, and whether its shape stays within the operator's bounds.

Classes exist so that long repository-scale jobs cannot take first-token latency away from interactive users
(deployment guide: "separate interactive and long-running traffic when they compete for the same cache and queue").
A request's class comes, in order, from the `x-m3gate-class` header (only if its key allows that class), from its
API key, or from the pool that fits it. Pure functions: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from policies.errors import RequestRejected
from policies.pool_choice import FORCED_POOL_HEADER, PoolChoice
from policies.config import BATCH_CLASS, ApiKeyConfig, InputLimitsConfig, PoolConfig, TrafficConfig

CLASS_HEADER = "x-m3gate-class"
SLO_TTFT_HEADER = "x-slo-ttft-ms"  # llm-d's names for per-request latency objectives
SLO_TPOT_HEADER = "x-slo-tpot-ms"

_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_MAX_NESTING = 3  # content inside tool results inside messages: deeper shapes are the classifier's to reject


def pool_class(traffic: TrafficConfig, pools_by_size: Sequence[PoolConfig], pool: str) -> str:
    """The class a pool serves by default: configured, else the class of the same name, else by size rank (the
    smallest pool gets the highest-priority class, the next one the next class, the rest the last class)."""
    if pool in traffic.pool_classes:
        return traffic.pool_classes[pool]
    if pool in traffic.classes:
        return pool
    # a background class (the Batch API's among them) is never a pool's default: it only fills spare capacity
    ranked = sorted((c for c, cfg in traffic.classes.items() if c != BATCH_CLASS and not cfg.background),
                    key=lambda name: (traffic.classes[name].priority, name)) or [BATCH_CLASS]
    rank = next((i for i, p in enumerate(pools_by_size) if p.name == pool), 0)
    return ranked[min(rank, len(ranked) - 1)]


def resolve_class(
    traffic: TrafficConfig,
    pools_by_size: Sequence[PoolConfig],
    pool: str,
    declared: str | None,
    key: ApiKeyConfig | None,
) -> str:
    """The request's class. `key` is None only when the gateway runs without keys (then any class may be declared)."""
    if declared:
        if declared not in traffic.classes:
            raise RequestRejected(
                f"The {CLASS_HEADER} header names traffic class '{declared}', which does not exist; use one of "
                f"{_names(traffic.classes)} or leave the header out.",
                param=CLASS_HEADER, code="unknown_traffic_class",
            )
        if key is not None and declared != key.traffic_class and declared not in key.allowed_classes:
            allowed = sorted({*key.allowed_classes, *([key.traffic_class] if key.traffic_class else [])})
            may = f"it may declare {_names(allowed)}" if allowed else "it may not declare a class"
            raise RequestRejected(
                f"API key '{key.name}' may not use traffic class '{declared}' ({may}); leave the {CLASS_HEADER} "
                "header out or ask the operator to allow the class for this key.",
                status=403, type="permission_error", param=CLASS_HEADER, code="traffic_class_not_allowed",
            )
        return declared
    if key is not None and key.traffic_class:
        return key.traffic_class
    return pool_class(traffic, pools_by_size, pool)


def request_priority(traffic: TrafficConfig, traffic_class: str, thinking_mode: str) -> int:
    """Queue and vLLM priority (lower is earlier). With thinking disabled a request answers without a long
    reasoning phase, so a user is probably waiting on it: it may take the latency class's priority even when long."""
    priority = traffic.classes[traffic_class].priority
    if traffic.latency_sensitive_disabled_thinking and thinking_mode == "disabled":
        priority = min(priority, traffic.classes[traffic.top_class()].priority)
    return priority


def request_slos(
    ttft_ms: str | None, tpot_ms: str | None, traffic: TrafficConfig, traffic_class: str, slo_aware: bool
) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) objectives in seconds: the request's x-slo-* headers, else, with SLO-aware routing on, its
    class's TTFT target. A header that is not a positive number of milliseconds is the caller's to fix (400)."""
    ttft = _slo_header(SLO_TTFT_HEADER, ttft_ms)
    tpot = _slo_header(SLO_TPOT_HEADER, tpot_ms)
    if ttft is None and slo_aware:
        cls = traffic.classes.get(traffic_class)
        ttft = cls.ttft_target_s if cls is not None else None
    return ttft, tpot


def _slo_header(name: str, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not (0.0 < ms < 86_400_000.0):
        raise RequestRejected(f"The {name} header must be a positive number of milliseconds (e.g. 800); got "
                              f"{value[:40]!r}.", param=name, code="invalid_header")
    return ms / 1000.0


def restrict_to_key(choice: PoolChoice, key: ApiKeyConfig | None, forced: bool) -> PoolChoice:
    """The pools of `choice` this key may use, in order; 403 when none. A key limited to small pools still gets
    a larger allowed pool its request may spill to, never a pool it is not allowed."""
    if key is None or key.pools is None:
        return choice
    allowed = tuple(p for p in choice.candidates if p.name in key.pools)
    if not allowed:
        raise RequestRejected(
            f"API key '{key.name}' may not use pool '{choice.pool.name}', which this request needs "
            f"({'named by the ' + FORCED_POOL_HEADER + ' header' if forced else 'the smallest pool that holds it'}); "
            f"this key may use {_names(key.pools)}. Send a request that fits those pools, or ask the operator "
            "for access.",
            status=403, type="permission_error", param=FORCED_POOL_HEADER if forced else None,
            code="pool_not_allowed",
        )
    if allowed == choice.candidates:
        return choice
    return replace(choice, pool=allowed[0], candidates=allowed)


def check_input_limits(body: dict[str, Any], api: str, limits: InputLimitsConfig) -> None:
    """Refuse, before any tokenizing, a request with too many messages or images or an oversized inline image."""
    field = "input" if api == "responses" else "messages"
    items = body.get(field) if api != "completions" else None
    if not isinstance(items, list):
        return
    if len(items) > limits.max_messages:
        raise RequestRejected(
            f"`{field}` has {len(items):,} entries; this gateway accepts at most {limits.max_messages:,}. "
            "Drop or summarise earlier turns.",
            param=field, code="too_many_messages",
        )
    images = 0
    for i, item in enumerate(items):
        if isinstance(item, dict) and isinstance(item.get("content"), list):
            images += _count_images(item["content"], f"{field}[{i}].content", limits, 0)
            if images > limits.max_images:
                raise RequestRejected(
                    f"This request carries more than {limits.max_images} images; send at most "
                    f"{limits.max_images} per request (split the work, or describe some images in text).",
                    param=field, code="too_many_images",
                )


def _count_images(parts: list[Any], where: str, limits: InputLimitsConfig, depth: int) -> int:
    images = 0
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if isinstance(kind, str) and kind in _IMAGE_PARTS:  # a list or object there is unhashable: not an image
            images += 1
            size = _inline_image_chars(part)
            if size > limits.max_image_data_url_bytes:
                raise RequestRejected(
                    f"The inline image at {where}[{j}] is {size:,} bytes of base64; this gateway accepts at most "
                    f"{limits.max_image_data_url_bytes:,} per image. Resize or recompress it, or send it by URL.",
                    status=413, param=f"{where}[{j}]", code="image_too_large",
                )
        elif depth < _MAX_NESTING and isinstance(part.get("content"), list):  # e.g. Anthropic tool_result
            images += _count_images(part["content"], f"{where}[{j}].content", limits, depth + 1)
    return images


def _inline_image_chars(part: dict[str, Any]) -> int:
    """Length of an inline image's data (data: URL or Anthropic base64 source); 0 for remote URLs."""
    for value in (part.get("image_url"), part.get("source")):
        if isinstance(value, dict):
            value = value.get("url", value.get("data"))
        if isinstance(value, str) and not value.startswith(("http://", "https://")):
            return len(value)
    return 0


def _names(names: Any) -> str:
    return ", ".join(f"'{n}'" for n in sorted(names))
