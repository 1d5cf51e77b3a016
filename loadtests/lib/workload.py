"""Workloads: a YAML description → a `Plan`, the exact list of requests a run will send and when.

A workload combines any of these sources (each optional, all merged into one plan):

- `classes`: independent requests drawn by weight from request classes, arriving by one `arrival` process. A class
  has distributions of prompt and output lengths, thinking-mode, image and tool-call shares, optional shared
  prefixes (system prompts drawn from groups) and per-class SLOs.
- `sessions`: multi-turn agent sessions. Sessions start by their own arrival process; each shares one of a few
  system prompts and its tool schemas, and its history grows turn by turn (assistant turns, tool calls and
  tool-result turns, user turns); the next turn is sent after the previous answer plus a think/tool time.
- `shape`: a standard workload for comparison with published results (performance.md §3): `sglang_gsp`,
  `prefix_repetition` (vLLM), `multi_round_qa` (production-stack), `inference_perf_shared_prefix`,
  `llmd_shared_prefix`.
- `trace`: replay of a recorded JSONL trace (Mooncake's `{timestamp, input_length, output_length, hash_ids}` or
  m3gate's `{timestamp, prompt_tokens, output_tokens, prefix_group, prefix_tokens, ...}`; results/<run>/requests.jsonl
  is itself such a trace).

All text comes from `loadtests.lib.textgen` (4 bytes = 1 token on the simulator), seeded by the workload's `seed`, so the
same file gives byte-identical requests every time, and the token structure (for the oracle hit rate) is known before
anything is sent. Assistant turns in agent histories are synthetic text of the requested output length (sent with
`ignore_eos` so the replica generates exactly that many tokens), which keeps the plan independent of the replies.

Distributions (`prompt_tokens`, `output_tokens`, `think_time_s`, ...): a number (constant), `[lo, hi]` (uniform
integers), or a mapping `{dist: constant|uniform|uniform_int|normal|lognormal|exponential|gamma|choice, ...,
min:, max:}`. Arrival processes: `{process: poisson|constant|gamma|bursts|ramp|stages, rate: ...}` (see
`arrival_times`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtests.lib.textgen import png_data_url, text, text_uncached

DEFAULT_MODEL = "MiniMaxAI/MiniMax-M3"
WORKLOAD_DIR = Path(__file__).parent / "workloads"


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the field."""


# ---------------------------------------------------------------------------------------------------------------
# Distributions


Sampler = Callable[[random.Random], float]


def sampler(spec: Any, where: str = "value") -> Sampler:
    """A function rng → number from a distribution spec (see the module docstring)."""
    if isinstance(spec, bool):
        raise WorkloadError(f"{where}: expected a number or a distribution, got {spec!r}")
    if isinstance(spec, (int, float)):
        value = float(spec)
        return lambda _r: value
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and all(isinstance(v, (int, float)) for v in spec):
        lo, hi = int(spec[0]), int(spec[1])
        return lambda r: float(r.randint(lo, hi))
    if not isinstance(spec, Mapping):
        raise WorkloadError(f"{where}: expected a number, [lo, hi] or a mapping with `dist`, got {spec!r}")
    kind = spec.get("dist", "constant")
    lo = spec.get("min")
    hi = spec.get("max")

    def need(key: str) -> float:
        if key not in spec:
            raise WorkloadError(f"{where}: dist {kind} needs `{key}`")
        return float(spec[key])

    base: Sampler
    if kind == "constant":
        v = need("value") if "value" in spec else need("mean")
        base = lambda _r: v  # noqa: E731
    elif kind == "uniform":
        a, b = need("min"), need("max")
        base = lambda r: r.uniform(a, b)  # noqa: E731
    elif kind == "uniform_int":
        a2, b2 = int(need("min")), int(need("max"))
        base = lambda r: float(r.randint(a2, b2))  # noqa: E731
    elif kind == "normal":
        mu, sd = need("mean"), need("std")
        base = lambda r: r.gauss(mu, sd)  # noqa: E731
    elif kind == "lognormal":
        sigma = need("sigma")
        mu = math.log(float(spec["median"])) if "median" in spec else math.log(need("mean")) - sigma * sigma / 2
        base = lambda r: r.lognormvariate(mu, sigma)  # noqa: E731
    elif kind == "exponential":
        mean = need("mean")
        base = lambda r: r.expovariate(1.0 / mean) if mean > 0 else 0.0  # noqa: E731
    elif kind == "gamma":
        mean, shape = need("mean"), need("shape")
        base = lambda r: r.gammavariate(shape, mean / shape)  # noqa: E731
    elif kind == "choice":
        values = [float(v) for v in spec.get("values") or []]
        if not values:
            raise WorkloadError(f"{where}: dist choice needs `values`")
        weights = spec.get("weights")
        base = lambda r: r.choices(values, weights=weights)[0]  # noqa: E731
    else:
        raise WorkloadError(f"{where}: unknown dist {kind!r}")
    if lo is None and hi is None:
        return base
    lo_f = -math.inf if lo is None else float(lo)
    hi_f = math.inf if hi is None else float(hi)
    return lambda r: min(hi_f, max(lo_f, base(r)))


def int_sampler(spec: Any, where: str, minimum: int = 0) -> Callable[[random.Random], int]:
    f = sampler(spec, where)
    return lambda r: max(minimum, int(round(f(r))))


# ---------------------------------------------------------------------------------------------------------------
# Arrival processes


def arrival_times(spec: Mapping[str, Any] | None, rnd: random.Random, *, count: int | None = None,
                  duration_s: float | None = None) -> list[float]:
    """Offsets (s) of arrivals, stopping at `count` arrivals or past `duration_s`, whichever comes first.

    - `poisson`: exponential gaps at `rate`/s (`rate: inf` sends everything at once, like `vllm bench serve`).
    - `constant`: one every 1/`rate` s.
    - `gamma`: vLLM's `--burstiness`: gamma gaps with shape `burstiness` and mean 1/`rate` (1 = Poisson).
    - `bursts`: `burst_size` requests at once every `burst_every_s` (default burst_size/`rate`), optional
      `jitter_s` spread inside a burst.
    - `ramp`: Poisson whose rate moves linearly from `start_rate` to `end_rate` over `ramp_s` (default the
      duration), then stays.
    - `stages`: a list of `{rate, duration_s, process}` run one after another (inference-perf's load stages).
    """
    spec = dict(spec or {"process": "poisson", "rate": math.inf})
    if count is None and duration_s is None:
        raise WorkloadError("arrival: needs a request count or a duration to stop at")
    limit_n = count if count is not None else 10**9
    limit_t = duration_s if duration_s is not None else math.inf
    process = spec.get("process", "poisson")
    out: list[float] = []

    def emit(t: float) -> bool:
        if len(out) >= limit_n or t > limit_t:
            return False
        out.append(t)
        return True

    if process == "stages":
        start = 0.0
        for i, stage in enumerate(spec.get("stages") or []):
            sub = {"process": stage.get("process", "poisson"), **stage}
            span = float(stage.get("duration_s", 0))
            times = arrival_times(sub, rnd, count=limit_n - len(out), duration_s=min(span, limit_t - start))
            for t in times:
                if not emit(start + t):
                    return out
            start += span
            if start >= limit_t:
                break
        return out
    rate = float(spec.get("rate", math.inf))
    if process in ("poisson", "constant", "gamma"):
        if math.isinf(rate):
            if count is None:
                raise WorkloadError("arrival: rate inf needs a request count")
            return [0.0] * count
        if rate <= 0:
            raise WorkloadError("arrival: rate must be > 0")
        t = 0.0
        shape = float(spec.get("burstiness", 1.0))
        while True:
            if process == "constant":
                gap = 1.0 / rate
            elif process == "gamma":
                gap = rnd.gammavariate(shape, 1.0 / (rate * shape))
            else:
                gap = rnd.expovariate(rate)
            if not emit(t):
                return out
            t += gap
    if process == "bursts":
        size = int(spec.get("burst_size", 10))
        every = float(spec.get("burst_every_s") or (size / rate if not math.isinf(rate) else 1.0))
        jitter = float(spec.get("jitter_s", 0.0))
        t = 0.0
        while True:
            for _ in range(size):
                if not emit(t + (rnd.uniform(0, jitter) if jitter else 0.0)):
                    out.sort()
                    return out
            t += every
    if process == "ramp":
        r0, r1 = float(spec.get("start_rate", 0.1)), float(spec.get("end_rate", rate))
        span = float(spec.get("ramp_s") or (duration_s or 60.0))
        t = 0.0
        while True:
            r = r0 + (r1 - r0) * min(1.0, t / span) if span > 0 else r1
            t += rnd.expovariate(max(r, 1e-6))
            if not emit(t):
                return out
    raise WorkloadError(f"arrival: unknown process {process!r}")


# ---------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | None) -> Slo:
        spec = spec or {}
        unknown = set(spec) - {"ttft_ms", "tpot_ms", "e2el_ms"}
        if unknown:
            raise WorkloadError(f"slo: unknown keys {sorted(unknown)} (ttft_ms, tpot_ms, e2el_ms)")
        return cls(**{k: float(v) for k, v in spec.items()})

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2el_ms", self.e2el_ms))
                if v is not None}


@dataclass
class Item:
    """One request of the plan."""

    index: int
    cls: str
    api: str  # "chat" | "completions"
    body: dict[str, Any]
    at: float = 0.0  # offset from the run's start (independent requests, and a session's first turn)
    session: str | None = None
    turn: int = 0
    wait_s: float = 0.0  # turns after the first: think/tool time after the previous answer (or interval)
    pacing: str = "completion"  # "completion": wait_s after the previous answer; "interval": wait_s after its send
    prefix_group: str | None = None
    prefix_tokens: int = 0
    prompt_tokens_est: int = 0
    output_tokens: int = 0
    thinking: bool = False
    tool_call: bool = False
    images: int = 0

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Plan:
    name: str
    items: list[Item]
    slos: dict[str, Slo] = field(default_factory=dict)
    duration_s: float | None = None
    max_requests: int | None = None
    seed: int = 0
    source: str = ""
    drain_s: float = 30.0
    timeout_s: float = 300.0

    def sessions(self) -> dict[str, list[Item]]:
        out: dict[str, list[Item]] = {}
        for item in self.items:
            if item.session is not None:
                out.setdefault(item.session, []).append(item)
        for turns in out.values():
            turns.sort(key=lambda i: i.turn)
        return out

    def independent(self) -> list[Item]:
        return sorted((i for i in self.items if i.session is None), key=lambda i: i.at)

    def classes(self) -> list[str]:
        seen: dict[str, None] = {}
        for item in self.items:
            seen.setdefault(item.cls, None)
        return list(seen)

    def summary(self) -> dict[str, Any]:
        sessions = self.sessions()
        return {"name": self.name, "requests": len(self.items), "sessions": len(sessions),
                "classes": self.classes(), "prompt_tokens_est": sum(i.prompt_tokens_est for i in self.items),
                "output_tokens": sum(i.output_tokens for i in self.items), "duration_s": self.duration_s,
                "max_requests": self.max_requests}


# ---------------------------------------------------------------------------------------------------------------
# Builders


@dataclass
class _Common:
    model: str
    stream: bool
    ignore_eos: bool
    seed: int
    image_size: tuple[int, int] = (512, 512)


def _tool_schemas(key: str, count: int, tokens_each: int) -> list[dict[str, Any]]:
    """`count` function schemas whose descriptions make each about `tokens_each` tokens once rendered."""
    tools = []
    for j in range(count):
        tools.append({"type": "function", "function": {
            "name": f"tool_{j}",
            "description": text(f"{key}/tool/{j}", max(1, tokens_each - 40)).strip(),
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
                           "required": ["path"]}}})
    return tools


def _chat_body(c: _Common, messages: list[dict[str, Any]], output_tokens: int, *, tools: list[dict[str, Any]] | None,
               tool_call: bool, thinking: bool | None, user: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": c.model, "messages": messages, "max_tokens": max(1, output_tokens)}
    if c.ignore_eos:
        body["ignore_eos"] = True
    if tools:
        body["tools"] = tools
        body["tool_choice"] = "required" if tool_call else "auto"
    if thinking is not None:
        body["chat_template_kwargs"] = {"thinking_mode": "enabled" if thinking else "disabled"}
    if user:
        body["user"] = user
    if c.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _completion_body(c: _Common, prompt: str, output_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": c.model, "prompt": prompt, "max_tokens": max(1, output_tokens)}
    if c.ignore_eos:
        body["ignore_eos"] = True
    if c.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _user_content(c: _Common, words: str, images: int, image_seed: int) -> Any:
    if not images:
        return words
    parts: list[dict[str, Any]] = [{"type": "text", "text": words}]
    w, h = c.image_size
    for k in range(images):
        parts.append({"type": "image_url", "image_url": {"url": png_data_url(w, h, image_seed * 7 + k)}})
    return parts


def _group_picker(spec: Mapping[str, Any], groups: int) -> Callable[[random.Random], int]:
    how = spec.get("distribution", "uniform")
    if how == "uniform":
        return lambda r: r.randrange(groups)
    if how == "zipf":
        s = float(spec.get("zipf_s", 1.1))
        weights = [1.0 / (k + 1) ** s for k in range(groups)]
        population = list(range(groups))
        return lambda r: r.choices(population, weights=weights)[0]
    raise WorkloadError(f"shared_prefix.distribution: unknown {how!r} (uniform, zipf)")


CLASS_KEYS = {"name", "weight", "api", "stream", "prompt_tokens", "output_tokens", "shared_prefix", "thinking_share",
              "image_share", "images_per_request", "tool_call_share", "tools", "slo"}


def _build_classes(spec: Mapping[str, Any], c: _Common, rnd: random.Random, start_index: int,
                   duration_s: float | None, max_requests: int | None) -> tuple[list[Item], dict[str, Slo]]:
    classes = spec.get("classes") or []
    if not classes:
        return [], {}
    count = spec.get("num_requests")
    arrival = spec.get("arrival") or {"process": "poisson", "rate": math.inf}
    unbounded_rate = arrival.get("process", "poisson") in ("poisson", "constant", "gamma") and math.isinf(
        float(arrival.get("rate", math.inf)))
    if count is None and (duration_s is None or unbounded_rate):
        count = max_requests
        if count is None:
            raise WorkloadError("classes: give num_requests, or a finite arrival rate and duration_s")
    times = arrival_times(arrival, rnd, count=count, duration_s=duration_s)
    parsed = []
    slos: dict[str, Slo] = {}
    for k, cs in enumerate(classes):
        where = f"classes[{k}]"
        unknown = set(cs) - CLASS_KEYS
        if unknown:
            raise WorkloadError(f"{where}: unknown keys {sorted(unknown)}")
        name = str(cs.get("name") or f"class{k}")
        shared = cs.get("shared_prefix") or {}
        tools_spec = cs.get("tools") or {}
        if isinstance(tools_spec, int):
            tools_spec = {"count": tools_spec}
        parsed.append({
            "name": name,
            "weight": float(cs.get("weight", 1.0)),
            "api": cs.get("api", spec.get("api", "chat")),
            "stream": bool(cs.get("stream", c.stream)),
            "prompt": int_sampler(cs.get("prompt_tokens", 256), f"{where}.prompt_tokens", 1),
            "output": int_sampler(cs.get("output_tokens", 128), f"{where}.output_tokens", 1),
            "groups": int(shared.get("groups", 0)),
            "group_tokens": int_sampler(shared.get("tokens", 0), f"{where}.shared_prefix.tokens"),
            "pick_group": _group_picker(shared, int(shared.get("groups", 1)) or 1),
            "thinking_share": cs.get("thinking_share"),
            "image_share": float(cs.get("image_share", 0.0)),
            "images": int_sampler(cs.get("images_per_request", 1), f"{where}.images_per_request", 1),
            "tool_call_share": float(cs.get("tool_call_share", 0.0)),
            "tools": _tool_schemas(f"{c.seed}/{name}", int(tools_spec.get("count", 0)),
                                   int(tools_spec.get("tokens_each", 120))) if tools_spec.get("count") else None,
        })
        slos[name] = Slo.parse(cs.get("slo"))
    if parsed[0]["api"] not in ("chat", "completions"):
        raise WorkloadError("classes: api must be chat or completions")
    group_len: dict[tuple[str, int], int] = {}
    weights = [p["weight"] for p in parsed]
    items = []
    for n, t in enumerate(times):
        p = rnd.choices(parsed, weights=weights)[0]
        idx = start_index + n
        cc = _Common(c.model, p["stream"], c.ignore_eos, c.seed, c.image_size)
        prompt_tokens = p["prompt"](rnd)
        output_tokens = p["output"](rnd)
        group = None
        prefix = ""
        if p["groups"]:
            g = p["pick_group"](rnd)
            key = (p["name"], g)
            if key not in group_len:
                group_len[key] = p["group_tokens"](random.Random(f"{c.seed}/{p['name']}/{g}"))
            group = f"{p['name']}/g{g}"
            prefix = text(f"{c.seed}/prefix/{group}", group_len[key])
        prefix_tokens = len(prefix) // 4
        tools_tokens = sum(len(json.dumps(t)) for t in p["tools"] or []) // 4
        unique = text_uncached(f"{c.seed}/req/{idx}", max(1, prompt_tokens - prefix_tokens - tools_tokens))
        thinking = None if p["thinking_share"] is None else rnd.random() < float(p["thinking_share"])
        images = p["images"](rnd) if rnd.random() < p["image_share"] else 0
        tool_call = bool(p["tools"]) and rnd.random() < p["tool_call_share"]
        if p["api"] == "completions":
            body = _completion_body(cc, prefix + unique, output_tokens)
        else:
            messages: list[dict[str, Any]] = []
            if prefix:
                messages.append({"role": "system", "content": prefix.strip()})
            messages.append({"role": "user", "content": _user_content(cc, unique.strip(), images, idx)})
            body = _chat_body(cc, messages, output_tokens, tools=p["tools"], tool_call=tool_call, thinking=thinking)
        items.append(Item(index=idx, cls=p["name"], api=p["api"], body=body, at=t, prefix_group=group,
                          prefix_tokens=prefix_tokens, prompt_tokens_est=prompt_tokens, output_tokens=output_tokens,
                          thinking=bool(thinking), tool_call=tool_call, images=images))
    return items, slos


SESSION_KEYS = {"name", "count", "arrival", "system_prompts", "tools", "turns", "first_user_tokens", "user_tokens",
                "tool_result_share", "tool_result_tokens", "output_tokens", "tool_call_output_tokens",
                "think_time_s", "tool_time_s", "thinking_share", "image_share", "slo", "pacing", "interval_s",
                "stream", "send_user", "max_context_tokens"}


def _build_sessions(group: Mapping[str, Any], k: int, c: _Common, rnd: random.Random, start_index: int,
                    duration_s: float | None) -> tuple[list[Item], Slo, str]:
    """Multi-turn agent sessions (see the module docstring)."""
    where = f"sessions[{k}]"
    unknown = set(group) - SESSION_KEYS
    if unknown:
        raise WorkloadError(f"{where}: unknown keys {sorted(unknown)}")
    name = str(group.get("name") or f"agent{k}")
    count = int(group.get("count", 10))
    starts = arrival_times(group.get("arrival") or {"process": "poisson", "rate": 1.0}, rnd, count=count,
                           duration_s=duration_s)
    sp = group.get("system_prompts") or {"count": 1, "tokens": 1000}
    n_sys = int(sp.get("count", 1))
    sys_tokens = int_sampler(sp.get("tokens", 1000), f"{where}.system_prompts.tokens", 1)
    pick_sys = _group_picker(sp, n_sys)
    tools_spec = group.get("tools") or {"count": 0}
    systems = []
    for j in range(n_sys):
        srnd = random.Random(f"{c.seed}/{name}/sys/{j}")
        tools = _tool_schemas(f"{c.seed}/{name}/sys/{j}", int(tools_spec.get("count", 0)),
                              int(tools_spec.get("tokens_each", 120))) if tools_spec.get("count") else None
        systems.append((text(f"{c.seed}/{name}/system/{j}", sys_tokens(srnd)).strip(), tools))
    turns = int_sampler(group.get("turns", [3, 8]), f"{where}.turns", 1)
    first_user = int_sampler(group.get("first_user_tokens", group.get("user_tokens", 200)),
                             f"{where}.first_user_tokens", 1)
    user_tokens = int_sampler(group.get("user_tokens", 100), f"{where}.user_tokens", 1)
    tool_share = float(group.get("tool_result_share", 0.6))
    tool_tokens = int_sampler(group.get("tool_result_tokens", 400), f"{where}.tool_result_tokens", 1)
    output = int_sampler(group.get("output_tokens", 120), f"{where}.output_tokens", 1)
    call_output = int_sampler(group.get("tool_call_output_tokens", group.get("output_tokens", 60)),
                              f"{where}.tool_call_output_tokens", 1)
    think = sampler(group.get("think_time_s", 1.0), f"{where}.think_time_s")
    tool_time = sampler(group.get("tool_time_s", 0.2), f"{where}.tool_time_s")
    thinking_share = group.get("thinking_share")
    image_share = float(group.get("image_share", 0.0))
    pacing = str(group.get("pacing", "completion"))
    if pacing not in ("completion", "interval"):
        raise WorkloadError(f"{where}.pacing: completion or interval")
    interval = sampler(group.get("interval_s", 0.0), f"{where}.interval_s")
    cc = _Common(c.model, bool(group.get("stream", c.stream)), c.ignore_eos, c.seed, c.image_size)
    send_user = bool(group.get("send_user", True))
    max_context = int(group.get("max_context_tokens", 10**9))
    items: list[Item] = []
    idx = start_index
    for s, start in enumerate(starts):
        sid = f"{name}-{s}"
        j = pick_sys(rnd)
        system, tools = systems[j]
        thinking = None if thinking_share is None else rnd.random() < float(thinking_share)
        history: list[dict[str, Any]] = [{"role": "system", "content": system}]
        n_turns = turns(rnd)
        first_images = 1 if rnd.random() < image_share else 0
        u = first_user(rnd)
        history.append({"role": "user", "content": _user_content(
            cc, text_uncached(f"{c.seed}/{sid}/u0", u).strip(), first_images, idx)})
        tokens = len(system) // 4 + (sum(len(json.dumps(t)) for t in tools or []) // 4) + u + 256 * first_images
        wait = 0.0
        for t in range(n_turns):
            if tokens > max_context:
                break
            tool_call = bool(tools) and t + 1 < n_turns and rnd.random() < tool_share
            out_tokens = call_output(rnd) if tool_call else output(rnd)
            body = _chat_body(cc, list(history), out_tokens, tools=tools, tool_call=tool_call, thinking=thinking,
                              user=sid if send_user else None)
            items.append(Item(index=idx, cls=name, api="chat", body=body, at=start, session=sid, turn=t,
                              wait_s=wait, pacing=pacing, prefix_group=f"{name}/sys{j}",
                              prefix_tokens=len(system) // 4, prompt_tokens_est=tokens, output_tokens=out_tokens,
                              thinking=bool(thinking), tool_call=tool_call,
                              images=first_images if t == 0 else 0))
            idx += 1
            # the answer, as the next turn's history holds it
            answer = text_uncached(f"{c.seed}/{sid}/a{t}", out_tokens).strip()
            if tool_call:
                history.append({"role": "assistant", "content": answer, "tool_calls": [{
                    "id": f"call_{sid}_{t}", "type": "function",
                    "function": {"name": tools[rnd.randrange(len(tools))]["function"]["name"],  # type: ignore[index]
                                 "arguments": json.dumps({"path": f"/src/{sid}/{t}.py"})}}]})
                r = tool_tokens(rnd)
                history.append({"role": "tool", "tool_call_id": f"call_{sid}_{t}",
                                "content": text_uncached(f"{c.seed}/{sid}/r{t}", r).strip()})
                wait = tool_time(rnd)
            else:
                history.append({"role": "assistant", "content": answer})
                r = user_tokens(rnd)
                history.append({"role": "user", "content": text_uncached(f"{c.seed}/{sid}/u{t + 1}", r).strip()})
                wait = think(rnd)
            if pacing == "interval":
                wait = interval(rnd)
            tokens += out_tokens + r + 12
    return items, Slo.parse(group.get("slo")), name


# ---- standard shapes (performance.md §3) ----------------------------------------------------------------------


def _shared_prefix_shape(c: _Common, rnd: random.Random, start: int, cls: str, *, groups: int, per_group: int,
                         prefix_len: int, question_len: int, output_len: int, shuffle: bool, api: str,
                         separator: str = "\n\n", range_ratio: float = 1.0) -> list[Item]:
    """`groups` prefixes × `per_group` prompts of prefix + separator + question (SGLang gsp / vLLM prefix_repetition
    / inference-perf shared_prefix / llm-d shared_prefix_synthetic)."""
    entries = [(g, q) for g in range(groups) for q in range(per_group)]
    if shuffle:
        rnd.shuffle(entries)
    items = []

    def jitter(n: int) -> int:
        if range_ratio >= 1.0:
            return n
        return max(1, rnd.randint(int(n * range_ratio), int(n * (2 - range_ratio))))

    for k, (g, q) in enumerate(entries):
        idx = start + k
        prefix = text(f"{c.seed}/{cls}/prefix/{g}", prefix_len).strip()
        question = text_uncached(f"{c.seed}/{cls}/q/{g}/{q}", jitter(question_len)).strip()
        out = jitter(output_len)
        if api == "completions":
            body = _completion_body(c, prefix + separator + question, out)
        else:
            body = _chat_body(c, [{"role": "system", "content": prefix}, {"role": "user", "content": question}], out,
                              tools=None, tool_call=False, thinking=None)
        items.append(Item(index=idx, cls=cls, api=api, body=body, prefix_group=f"{cls}/g{g}", prefix_tokens=prefix_len,
                          prompt_tokens_est=prefix_len + question_len + 1, output_tokens=out))
    return items


def _assign_arrivals(items: list[Item], arrival: Mapping[str, Any] | None, rnd: random.Random) -> None:
    times = arrival_times(arrival or {"process": "poisson", "rate": math.inf}, rnd, count=len(items))
    for item, t in zip(items, times):
        item.at = t
    del items[len(times):]


SHAPE_DEFAULTS: dict[str, dict[str, Any]] = {
    # SGLang bench_serving --dataset-name generated-shared-prefix defaults
    "sglang_gsp": {"num_groups": 64, "prompts_per_group": 16, "system_prompt_len": 2048, "question_len": 128,
                   "output_len": 256, "range_ratio": 1.0, "ordered": False, "api": "completions"},
    # vllm bench serve --dataset-name prefix_repetition defaults (num_prompts: vllm bench's default 1000)
    "prefix_repetition": {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 10, "output_len": 128,
                          "num_prompts": 1000, "shuffle": True, "api": "completions"},
    # inference-perf data.type shared_prefix defaults
    "inference_perf_shared_prefix": {"num_groups": 10, "num_prompts_per_group": 10, "system_prompt_len": 100,
                                     "question_len": 50, "output_len": 50, "api": "chat"},
    # llm-d-benchmark shared_prefix_synthetic
    "llmd_shared_prefix": {"num_groups": 32, "prompts_per_group": 32, "prefix_len": 2048, "question_len": 256,
                           "output_len": 256, "api": "completions"},
    # vLLM production-stack benchmarks/multi-round-qa (README example; run.sh uses 320 users, 10 rounds, 20000)
    "multi_round_qa": {"num_users": 10, "num_rounds": 5, "qps": 0.5, "shared_system_prompt": 1000,
                       "user_history_prompt": 2000, "answer_len": 100, "question_len": 32},
}


def _build_shape(shape: Mapping[str, Any], c: _Common, rnd: random.Random, start: int,
                 duration_s: float | None) -> tuple[list[Item], dict[str, Slo]]:
    name = shape.get("name")
    if name not in SHAPE_DEFAULTS:
        raise WorkloadError(f"shape.name: one of {sorted(SHAPE_DEFAULTS)}")
    p = {**SHAPE_DEFAULTS[name], **{k: v for k, v in shape.items() if k not in ("name", "arrival", "slo")}}
    unknown = set(p) - set(SHAPE_DEFAULTS[name])
    if unknown:
        raise WorkloadError(f"shape {name}: unknown parameters {sorted(unknown)}; known {sorted(SHAPE_DEFAULTS[name])}")
    slo = {name: Slo.parse(shape.get("slo"))}
    api = p.get("api", "chat")
    if name == "sglang_gsp":
        items = _shared_prefix_shape(c, rnd, start, name, groups=p["num_groups"], per_group=p["prompts_per_group"],
                                     prefix_len=p["system_prompt_len"], question_len=p["question_len"],
                                     output_len=p["output_len"], shuffle=not p["ordered"], api=api,
                                     range_ratio=float(p["range_ratio"]))
    elif name == "prefix_repetition":
        per = int(p["num_prompts"]) // int(p["num_prefixes"])
        items = _shared_prefix_shape(c, rnd, start, name, groups=p["num_prefixes"], per_group=per,
                                     prefix_len=p["prefix_len"], question_len=p["suffix_len"],
                                     output_len=p["output_len"], shuffle=p["shuffle"], api=api, separator="")
    elif name == "inference_perf_shared_prefix":
        items = _shared_prefix_shape(c, rnd, start, name, groups=p["num_groups"], per_group=p["num_prompts_per_group"],
                                     prefix_len=p["system_prompt_len"], question_len=p["question_len"],
                                     output_len=p["output_len"], shuffle=True, api=api)
    elif name == "llmd_shared_prefix":
        items = _shared_prefix_shape(c, rnd, start, name, groups=p["num_groups"], per_group=p["prompts_per_group"],
                                     prefix_len=p["prefix_len"], question_len=p["question_len"],
                                     output_len=p["output_len"], shuffle=True, api=api)
    else:  # multi_round_qa
        users, rounds, qps = int(p["num_users"]), int(p["num_rounds"]), float(p["qps"])
        group = {
            "name": name, "count": users,
            # users join one per (users/qps)/users = 1/qps s; each then asks every users/qps s (QPS overall)
            "arrival": {"process": "constant", "rate": qps},
            "system_prompts": {"count": 1, "tokens": int(p["shared_system_prompt"])},
            "turns": rounds, "first_user_tokens": int(p["user_history_prompt"]) + int(p["question_len"]),
            "user_tokens": int(p["question_len"]), "tool_result_share": 0.0, "output_tokens": int(p["answer_len"]),
            "pacing": "interval", "interval_s": users / qps, "send_user": True,
        }
        items, s, _ = _build_sessions(group, 0, c, rnd, start, None)
        return items, {name: s if s.as_dict() else slo[name]}
    _assign_arrivals(items, shape.get("arrival"), rnd)
    return items, slo


# ---- trace replay -----------------------------------------------------------------------------------------------


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{n}: not JSON: {exc}") from None
    return records


def _build_trace(spec: Mapping[str, Any], c: _Common, start: int, base_dir: Path | None) -> list[Item]:
    """Replay: each record keeps its arrival time, prompt and output lengths and prefix structure.

    Mooncake records (`hash_ids`) become one `block_tokens` (512) text block per hash id, so equal ids are equal
    text; m3gate records use `prefix_group` + `prefix_tokens` for the shared head. `time_scale` multiplies
    timestamps (0.5 = twice as fast); Mooncake timestamps are milliseconds (`time_unit: ms`)."""
    path = Path(spec["path"])
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    records = load_trace(path)
    if not records:
        return []
    fmt = spec.get("format") or ("mooncake" if "hash_ids" in records[0] else "m3gate")
    unit = spec.get("time_unit") or ("ms" if fmt == "mooncake" else "s")
    scale = float(spec.get("time_scale", 1.0)) * (0.001 if unit == "ms" else 1.0)
    block = int(spec.get("block_tokens", 512))
    limit = spec.get("max_records")
    t0 = min(float(r.get("timestamp", 0)) for r in records)
    items = []
    for k, r in enumerate(records[: int(limit) if limit else None]):
        idx = start + k
        at = (float(r.get("timestamp", 0)) - t0) * scale
        prompt_tokens = int(r.get("input_length", r.get("prompt_tokens", 256)))
        out = int(r.get("output_length", r.get("output_tokens", 128)))
        cls = str(r.get("class", spec.get("class", "trace")))
        if fmt == "mooncake":
            ids = list(r.get("hash_ids") or [])
            bt = int(r.get("block_tokens", block))
            parts = [text(f"{c.seed}/mc/{bt}/{h}", bt) for h in ids[:-1]]
            covered = bt * len(parts)
            parts.append(text_uncached(f"{c.seed}/mc/{ids[-1] if ids else 'x'}/{idx}", max(1, prompt_tokens - covered))
                         if ids else text_uncached(f"{c.seed}/mc/{idx}", prompt_tokens))
            prefix_group = f"mc/{ids[0]}" if ids else None
            prefix_tokens = covered
            prompt = "".join(parts)
            system, user = None, prompt.strip()
        else:
            group = r.get("prefix_group")
            prefix_tokens = int(r.get("prefix_tokens", 0)) if group is not None else 0
            system = text(f"{c.seed}/tp/{group}", prefix_tokens).strip() if prefix_tokens else None
            user = text_uncached(f"{c.seed}/tr/{idx}", max(1, prompt_tokens - prefix_tokens)).strip()
            prefix_group = None if group is None else str(group)
        api = r.get("api", spec.get("api", "chat"))
        images = int(r.get("images", 0))
        thinking = r.get("thinking")
        tool_call = bool(r.get("tool_call", False))
        if api == "completions":
            body = _completion_body(c, ((system + " ") if system else "") + user, out)
        else:
            messages: list[dict[str, Any]] = []
            if system:
                messages.append({"role": "system", "content": system})
            messages.append({"role": "user", "content": _user_content(c, user, images, idx)})
            wants_tools = tool_call or r.get("tools")
            tools = _tool_schemas(f"{c.seed}/trace", int(r.get("tools", 4)), 120) if wants_tools else None
            body = _chat_body(c, messages, out, tools=tools, tool_call=tool_call,
                              thinking=None if thinking is None else bool(thinking),
                              user=str(r["session"]) if r.get("session") else None)
        items.append(Item(index=idx, cls=cls, api=api, body=body, at=at, prefix_group=prefix_group,
                          prefix_tokens=prefix_tokens, prompt_tokens_est=prompt_tokens, output_tokens=out,
                          thinking=bool(thinking), tool_call=tool_call, images=images))
    return items


# ---------------------------------------------------------------------------------------------------------------
# Entry points

TOP_KEYS = {"name", "seed", "model", "api", "stream", "ignore_eos", "duration_s", "max_requests", "num_requests",
            "arrival", "classes", "sessions", "shape", "trace", "image_size", "drain_s", "timeout_s", "description"}


def build_plan(spec: Mapping[str, Any], *, base_dir: Path | None = None, source: str = "",
               overrides: Mapping[str, Any] | None = None) -> Plan:
    """A validated plan from a workload mapping (what a YAML file holds)."""
    spec = {**spec, **(overrides or {})}
    unknown = set(spec) - TOP_KEYS
    if unknown:
        raise WorkloadError(f"unknown top-level keys {sorted(unknown)}; known: {sorted(TOP_KEYS)}")
    seed = int(spec.get("seed", 0))
    rnd = random.Random(seed)
    size = spec.get("image_size", [512, 512])
    c = _Common(model=str(spec.get("model", DEFAULT_MODEL)), stream=bool(spec.get("stream", True)),
                ignore_eos=bool(spec.get("ignore_eos", True)), seed=seed, image_size=(int(size[0]), int(size[1])))
    duration = spec.get("duration_s")
    duration_s = float(duration) if duration is not None else None
    max_requests = spec.get("max_requests")
    max_requests = int(max_requests) if max_requests is not None else None
    items: list[Item] = []
    slos: dict[str, Slo] = {}
    got, s = _build_classes(spec, c, rnd, len(items), duration_s, max_requests)
    items += got
    slos.update(s)
    for k, group in enumerate(spec.get("sessions") or []):
        got, slo, name = _build_sessions(group, k, c, rnd, len(items), duration_s)
        items += got
        slos[name] = slo
    if spec.get("shape"):
        got, s = _build_shape(spec["shape"], c, rnd, len(items), duration_s)
        items += got
        slos.update(s)
    if spec.get("trace"):
        got = _build_trace(spec["trace"], c, len(items), base_dir)
        items += got
        for cls in {i.cls for i in got}:
            slos.setdefault(cls, Slo.parse((spec["trace"] or {}).get("slo")))
    if not items:
        raise WorkloadError("the workload has no requests: give classes, sessions, shape or trace")
    return Plan(name=str(spec.get("name") or "workload"), items=items, slos=slos, duration_s=duration_s,
                max_requests=max_requests, seed=seed, source=source, drain_s=float(spec.get("drain_s", 30.0)),
                timeout_s=float(spec.get("timeout_s", 300.0)))


def resolve_workload(name_or_path: str) -> Path:
    """A path, or the name of a file under loadtests/lib/workloads/ (with or without .yaml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for cand in (WORKLOAD_DIR / name_or_path, WORKLOAD_DIR / f"{name_or_path}.yaml"):
        if cand.exists():
            return cand
    raise WorkloadError(f"no workload {name_or_path!r} (a path, or one of: "
                        f"{', '.join(sorted(x.stem for x in WORKLOAD_DIR.glob('*.yaml')))})")


def load_workload(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> Plan:
    path = resolve_workload(name_or_path)
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(spec, dict):
        raise WorkloadError(f"{path}: a workload is a mapping")
    return build_plan(spec, base_dir=path.parent, source=str(path), overrides=overrides)
