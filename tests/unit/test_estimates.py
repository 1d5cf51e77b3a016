"""policies/estimates.py and the pool-choice helpers that act on it: vLLM's over-length 400 read exactly as vLLM 0.32
words it, and the learnt ratio's bounds, warm-up and reporting."""

from __future__ import annotations

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
    ratios = TokenEstimateRatios(alpha=0.5, low=0.5, high=8.0, min_samples=3)
    assert ratios.ratio("p") == 1.0
    ratios.observe("p", 1000, 7000)
    ratios.observe("p", 1000, 7000)
    assert ratios.ratio("p") == 1.0  # two samples: not yet
    assert ratios.observe("p", 1000, 7000) is True  # trusted now, and it moved: worth one log line
    assert ratios.ratio("p") == pytest.approx(7.0)
    assert ratios.observe("p", 1000, 7100) is False  # a small move is not reported again
    for _ in range(20):
        ratios.observe("p", 10, 10_000)  # 1000x: clamped to the bound
    assert ratios.ratio("p") == pytest.approx(8.0, rel=1e-3)
    assert ratios.observe("p", 0, 100) is False and ratios.observe("p", 100, 0) is False  # nothing to learn
    close = TokenEstimateRatios(min_samples=1, dead_band=0.05)
    close.observe("q", 1000, 1040)
    assert close.ratio("q") == 1.0  # within the estimate's own margin: not worth a second pool choice
    ratios.keep_only({"q"})
    assert ratios.view() == {}


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
                              model_counted=False, estimate_error=0.07)
    copy = original.with_prompt_tokens(1234)
    assert copy is not original and copy.prompt_tokens == 1234
    assert [(f.name, getattr(copy, f.name)) for f in fields(RequestProfile) if f.name != "prompt_tokens"] == [
        (f.name, getattr(original, f.name)) for f in fields(RequestProfile) if f.name != "prompt_tokens"]
    assert len(fields(RequestProfile)) == 14  # with_prompt_tokens passes 14
