"""The demo's sample workload (gateway/cli/demo_workload.py): every kind early and at its cadence, each body shaped for
the pool it is meant to reach."""

from __future__ import annotations

from collections import Counter
from itertools import takewhile

from gateway.cli.demo_workload import KINDS, REPOSITORY_TOKENS, request_body, schedule
from policies.classify import classify
from policies.config import ClassificationConfig
from policies.tokens import TokenCounter

MODEL = "MiniMaxAI/MiniMax-M3"


def test_every_kind_comes_within_the_first_seconds() -> None:
    first = list(takewhile(lambda e: e[0] < 5.0, schedule(seed=3)))
    assert set(KINDS) == {"chat", "reasoning", "agent", "repository", "document", "batch"}
    assert {kind for _, kind in first} == set(KINDS)


def test_the_mix_over_ten_minutes_is_light_and_mostly_chat() -> None:
    events = list(takewhile(lambda e: e[0] < 600.0, schedule(seed=1)))
    assert [t for t, _ in events] == sorted(t for t, _ in events)
    per_kind = Counter(kind for _, kind in events)
    assert set(per_kind) == set(KINDS)
    assert 1.0 <= len(events) / 600 <= 4.0  # a few requests (agent sessions count once) a second
    assert per_kind["chat"] > per_kind["reasoning"] > per_kind["document"]
    assert per_kind["agent"] > per_kind["document"] and per_kind["repository"] > per_kind["document"]
    assert 5 <= per_kind["document"] <= 15  # one every minute or so
    assert per_kind["document"] < per_kind["batch"] < per_kind["repository"]  # a small batch job every ~30 s


def test_each_body_is_shaped_for_its_pool() -> None:
    cfg = ClassificationConfig()
    counter = TokenCounter(cfg)

    def tokens(kind: str) -> int:
        return classify(request_body(kind, 1, MODEL), "chat", cfg, counter).prompt_tokens

    assert tokens("chat") < 1000 and tokens("reasoning") < 1000
    assert 32768 < tokens("repository") < 131072 - 8192
    assert tokens("document") > 131072
    assert REPOSITORY_TOKENS > 32768
    reasoning = request_body("reasoning", 1, MODEL)
    assert reasoning["stream"] and reasoning["chat_template_kwargs"] == {"thinking_mode": "enabled"}
    assert classify(reasoning, "chat", cfg, counter).thinking_mode == "enabled"
    chats = [request_body("chat", n, MODEL) for n in range(8)]
    assert any(b["stream"] for b in chats) and not all(b["stream"] for b in chats)
    assert all(b["model"] == MODEL for b in chats)
