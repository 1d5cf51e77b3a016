"""policies/estimates.py and the pool-choice helpers that act on it: vLLM's over-length 400 read exactly as vLLM 0.32
words it, and the learnt ratio's bounds, warm-up and reporting."""

from __future__ import annotations

import random

import orjson
import pytest

from policies.classify import RequestProfile
from policies.config import PoolConfig
from policies.estimates import TokenEstimateRatios, overlength_tokens
from policies.pool_choice import after_overlength, with_learned_ratio


def _vllm_400(message: str, param: str | None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}})


def test_over_length_messages_as_vllm_words_them() -> None:
    exact = ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, "
             "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
             "(parameter=input_tokens, value=5000)")
    truncated = exact.replace("contains 5000", "contains at least 4097")
    chars = ("This model's maximum context length is 4096 tokens. However, your prompt contains 99999 characters (more "
             "than 16384 characters, which is the upper bound for 4096 input tokens). Please reduce the length of the "
             "input prompt.")
    assert overlength_tokens(_vllm_400(exact, "input_tokens")) == 5000
    assert overlength_tokens(_vllm_400(truncated, "input_tokens")) == 4097
    assert overlength_tokens(_vllm_400(chars, "input_text")) == 0


@pytest.mark.parametrize("body", [
    _vllm_400("max_tokens=9000 cannot be greater than max_model_len=4096. Please request fewer output tokens.",
              "max_tokens"),
    _vllm_400("1 validation error: messages field required", "messages"),
    b"not json, but it says maximum context length",
    orjson.dumps({"error": "maximum context length is"}),
    b"",
])
def test_other_400s_are_not_over_length(body: bytes) -> None:
    assert overlength_tokens(body) is None


def test_the_ratio_is_trusted_after_min_samples_and_bounded() -> None:
    ratios = TokenEstimateRatios(low=0.5, high=8.0, min_samples=3)
    assert ratios.ratio("p") == 1.0
    ratios.observe("p", 1000, 7000, 0.0)
    ratios.observe("p", 1000, 7000, 0.0)
    assert ratios.ratio("p") == 1.0  # two samples: not yet
    assert ratios.observe("p", 1000, 7000, 0.0) is True  # trusted now, and it moved: worth one log line
    assert ratios.ratio("p") == pytest.approx(7.0)
    assert ratios.observe("p", 1000, 7100, 100.0) is False  # a small move is not reported again
    for i in range(100):
        ratios.observe("p", 10, 10_000, 200.0 + i)  # 1000x: clamped to the bound
    assert ratios.ratio("p") == pytest.approx(8.0, rel=1e-3)
    assert ratios.observe("p", 0, 100, 400.0) is False and ratios.observe("p", 100, 0, 400.0) is False  # nothing
    close = TokenEstimateRatios(min_samples=1, dead_band=0.05)
    close.observe("q", 1000, 1040, 0.0)
    assert close.ratio("q") == 1.0  # within the estimate's own margin: not worth a second pool choice
    ratios.keep_only({"q"})
    assert ratios.view() == {}


def _feed(ratios: TokenEstimateRatios, stream: list[float], every: float = 0.3) -> tuple[list[float], int]:
    """Each ratio as one answer, `every` seconds apart: the ratio applied after each, and how many were logged."""
    used, logged = [], 0
    for i, r in enumerate(stream):
        logged += ratios.observe("p", 1000, round(1000 * r), now=i * every)
        used.append(ratios.ratio("p"))
    return used, logged


@pytest.mark.parametrize("typical", [0.9, 1.2, 3.0])
def test_the_ratio_converges_despite_outliers(typical: float) -> None:
    """A fifth of the prompts unusual (random-token prompts, code, CJK: 0.55×, 1.39×, or far off at 0.1× and 20×):
    after a warm-up the applied ratio stays within 5% of the pool's typical one, every sample, and is logged once."""
    rng = random.Random(40)
    stream = [rng.choice((0.1, 20.0, 0.55, 1.39)) if rng.random() < 0.2 else typical * rng.uniform(0.97, 1.03)
              for _ in range(800)]
    used, logged = _feed(TokenEstimateRatios(), stream)
    assert all(abs(u / typical - 1) < 0.05 for u in used[30:]), (min(used[30:]), max(used[30:]))
    assert logged == 1


@pytest.mark.parametrize("order", ["random", "alternating", "bursts"])
def test_alternating_unusual_prompts_settle_instead_of_swinging(order: str) -> None:
    """Issue 40: under GuideLLM / inference-perf, a pool whose prompts alternate between two kinds (0.55× and 1.39×)
    had its factor swing between the two (six times within 2 s) and logged 18 times in 30 minutes. Now, once its
    window has filled, the ratio stays within ±8% of one value between the two, and 30 minutes log it twice: once
    trusted (its first three samples), once settled a minute later."""
    rng = random.Random(7)
    kinds = (0.55, 1.39)
    pick = {"random": lambda i: rng.choice(kinds), "alternating": lambda i: kinds[i % 2],
            "bursts": lambda i: kinds[(i // 20) % 2]}[order]
    stream = [pick(i) for i in range(6000)]  # 30 minutes at 0.3 s
    used, logged = _feed(TokenEstimateRatios(), stream)
    settled = used[256:]
    assert 0.55 < min(settled) and max(settled) < 1.39
    assert max(settled) / min(settled) < 1.17, (min(settled), max(settled))
    assert logged == 2
    other = TokenEstimateRatios()
    for i in range(20):
        other.observe("q", 1000, 1000, now=i)
    assert other.ratio("q") == 1.0  # per pool: "p"'s traffic does not move "q"


def test_an_over_length_count_is_a_lower_bound_that_only_raises_the_ratio() -> None:
    """vLLM's over-length 400 counts a truncated prompt ("at least 8193"): prompts estimated at 1100, 1500 and 2000
    tokens that all bounced say the ratio is at least 7.4, not their median 5.5 (which would bounce the next
    1200-token estimate again)."""
    ratios = TokenEstimateRatios()
    for estimated in (1100, 1500, 2000):
        ratios.observe("small", estimated, 8193, now=0.0, at_least=True)
    assert ratios.ratio("small") == pytest.approx(8193 / 1100)
    ratios.observe("small", 1000, 2000, now=1.0)
    assert ratios.ratio("small") == pytest.approx(8193 / 1100)  # one exact count far off: an outlier
    for i in range(5):
        ratios.observe("small", 1000, 2000, now=2.0 + i)
    assert ratios.ratio("small") < 3.5  # most counts now say 2×: exact counts bring it down


def test_a_change_is_logged_only_when_material_and_once_a_minute_per_pool() -> None:
    ratios = TokenEstimateRatios(window=8)
    logged: list[tuple[str, float, float]] = []

    def feed(pool: str, ratio: float, now: float) -> None:
        if ratios.observe(pool, 1000, round(1000 * ratio), now):
            logged.append((pool, now, ratios.ratio(pool)))

    for i in range(8):
        feed("a", 2.0, i * 0.1)
    assert [(p, t) for p, t, _ in logged] == [("a", 0.2)]  # trusted at the third sample: 2.0× from 1.0×
    feed("b", 3.0, 0.5), feed("b", 3.0, 0.6), feed("b", 3.0, 0.7)
    assert [p for p, _, _ in logged] == ["a", "b"]  # another pool logs on its own clock
    for i in range(8):
        feed("a", 4.0, 1.0 + i * 0.1)  # material (2× → 4×) but within the minute of the last line: held back
    assert len(logged) == 2
    feed("a", 4.0, 60.3)  # a minute on, still material: logged once, with the value it settled on
    assert logged[-1][:2] == ("a", 60.3) and logged[-1][2] == pytest.approx(4.0)
    for i in range(40):
        feed("a", 4.0 * (1.09 if i % 2 else 0.92), 120.0 + i * 30)  # under 10% from the logged 4.0×: never
    assert len(logged) == 3
    for i in range(8):
        feed("a", 2.0, 2000.0 + i)
    assert len(logged) == 4 and logged[-1][1] == 2002.0  # a real shift back is logged once the window turns


def _profile(tokens: int, modalities: frozenset[str] = frozenset({"text"}), counted: bool = False) -> RequestProfile:
    return RequestProfile("chat", None, tokens, 256, True, modalities, "adaptive", False, model_counted=counted)


POOLS = [PoolConfig(name="s", max_model_len=8192, endpoints=["http://a"]),
         PoolConfig(name="m", max_model_len=32768, endpoints=["http://b"], modalities=["text", "image"]),
         PoolConfig(name="l", max_model_len=65536, endpoints=["http://c"])]


def test_after_overlength_goes_to_the_smallest_larger_pool_that_holds_the_count() -> None:
    choice = after_overlength(_profile(2000), POOLS, POOLS[0], 8193)
    assert choice is not None and [p.name for p in choice.candidates] == ["m", "l"]
    assert choice.reason == "overlength:s"
    assert [p.name for p in after_overlength(_profile(2000), POOLS, POOLS[0], 40_000).candidates] == ["l"]  # type: ignore[union-attr]
    images = after_overlength(_profile(2000, frozenset({"text", "image"})), POOLS, POOLS[1], 0)
    assert images is None  # the only larger pool takes no images: vLLM's 400 stands
    assert after_overlength(_profile(2000), POOLS, POOLS[2], 70_000) is None


def test_a_learnt_ratio_scales_estimates_but_not_model_counts() -> None:
    assert with_learned_ratio(_profile(1000), 7.2).prompt_tokens == 7200
    counted = _profile(1000, counted=True)
    assert with_learned_ratio(counted, 7.2) is counted
    plain = _profile(1000)
    assert with_learned_ratio(plain, 1.0) is plain


def test_with_prompt_tokens_copies_every_other_field() -> None:
    """The fast copy passes fields by position: a field added to RequestProfile and not to it fails here."""
    from dataclasses import fields

    original = RequestProfile("responses", "m", 10, 99, True, frozenset({"text", "image"}), "enabled", True,
                              n_images=2, n_videos=1, estimate_exact=False, budget_field="max_output_tokens",
                              model_counted=False, estimate_error=0.07, estimate_refinable=True)
    copy = original.with_prompt_tokens(1234)
    assert copy is not original and copy.prompt_tokens == 1234
    assert [(f.name, getattr(copy, f.name)) for f in fields(RequestProfile) if f.name != "prompt_tokens"] == [
        (f.name, getattr(original, f.name)) for f in fields(RequestProfile) if f.name != "prompt_tokens"]
    assert len(fields(RequestProfile)) == 15  # with_prompt_tokens passes 15
