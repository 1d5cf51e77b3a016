"""policies.pool_choice over real token counts: prompts are built to their intended size with the real tokenizer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from loadtests.lib.agent_corpus import TextCorpus, text_with_tokens
from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.pool_choice import PoolChoice, choose_pool, with_exact_prompt_tokens
from policies.tokens import TokenCounter
from policies.config import ClassificationConfig, PoolConfig

CFG = ClassificationConfig()  # safety margin 3%, boundary band 10%, default budgets 32K / 16K / 4K
INTERACTIVE = PoolConfig(name="interactive", max_model_len=32_768, modalities=["text"])
REPOSITORY = PoolConfig(name="repository", max_model_len=131_072, modalities=["text", "image"])
EXTENDED = PoolConfig(name="extended", max_model_len=1_048_576, modalities=["text", "image", "video"])
POOLS = [INTERACTIVE, REPOSITORY, EXTENDED]
PNG_1X1 = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
           "RU5ErkJggg==")


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter(CFG)


@pytest.fixture(scope="module")
def text_of(counter: TokenCounter) -> Any:
    """text_of(n) → mixed realistic text of exactly n tiktoken tokens (memoised: big ones cost ~0.1 s each)."""
    corpus = TextCorpus()
    made: dict[int, str] = {}

    def make(n_tokens: int) -> str:
        if n_tokens not in made:
            made[n_tokens] = text_with_tokens(corpus, "mixed", n_tokens, random.Random(n_tokens))
            assert counter.count_exact(made[n_tokens]) == pytest.approx(n_tokens, abs=3)
        return made[n_tokens]

    return make


def chat_profile(counter: TokenCounter, text: str, **extra: Any) -> RequestProfile:
    body = {"model": "MiniMaxAI/MiniMax-M3", "messages": [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": text}], **extra}
    return classify(body, "chat", CFG, counter)


def choose(profile: RequestProfile, **kwargs: Any) -> PoolChoice:
    return choose_pool(profile, POOLS, CFG, **kwargs)


def names(choice: PoolChoice) -> list[str]:
    return [p.name for p in choice.candidates]


# ---------------------------------------------------------------------------------------------------------------
# The smallest pool that holds the request


def test_short_chat_goes_to_the_interactive_pool(counter: TokenCounter) -> None:
    choice = choose(chat_profile(counter, "How do I reverse a list in Python?"))
    assert choice.pool == INTERACTIVE and choice.reason == "fits" and not choice.needs_exact_count
    assert names(choice) == ["interactive", "repository", "extended"]


def test_60k_prompt_goes_to_the_repository_pool(counter: TokenCounter, text_of: Any) -> None:
    profile = chat_profile(counter, text_of(60_000))
    assert not profile.estimate_exact  # sampled, within the bound it states
    assert profile.prompt_tokens == pytest.approx(60_000, rel=profile.estimate_error)
    choice = choose(profile)
    assert choice.pool == REPOSITORY and names(choice) == ["repository", "extended"]


def test_300k_prompt_goes_to_the_extended_pool(counter: TokenCounter, text_of: Any) -> None:
    profile = chat_profile(counter, text_of(300_000))
    assert not profile.estimate_exact  # long enough to be sampled
    assert profile.prompt_tokens == pytest.approx(300_000, rel=0.03)
    choice = choose(profile)
    assert choice.pool == EXTENDED and names(choice) == ["extended"] and not choice.needs_exact_count


def test_output_budget_counts_toward_the_context(counter: TokenCounter, text_of: Any) -> None:
    """30K of prompt fits 32K alone; with max_tokens 8K it does not, so it goes to the repository pool."""
    text = text_of(20_000)
    assert choose(chat_profile(counter, text, max_tokens=8_000)).pool == INTERACTIVE
    profile = chat_profile(counter, text_of(30_000), max_tokens=8_000)
    assert profile.budget_explicit and profile.context_tokens > INTERACTIVE.max_model_len
    assert choose(profile).pool == REPOSITORY


def test_default_budget_of_the_thinking_mode_decides(counter: TokenCounter, text_of: Any) -> None:
    """20K of prompt: thinking enabled reserves 32K of output (→ repository); disabled reserves 4K (→ interactive)."""
    text = text_of(20_000)
    enabled = chat_profile(counter, text, chat_template_kwargs={"thinking_mode": "enabled"})
    assert (enabled.output_budget, enabled.budget_explicit) == (CFG.output_budget.enabled, False)
    assert choose(enabled).pool == REPOSITORY
    disabled = chat_profile(counter, text, chat_template_kwargs={"thinking_mode": "disabled"})
    assert disabled.output_budget == CFG.output_budget.disabled
    assert choose(disabled).pool == INTERACTIVE


def test_default_budget_that_fits_nowhere_is_clamped_in_the_largest_pool() -> None:
    """No explicit max_tokens: vLLM clamps the output to what is left, so a prompt that fits alone is served."""
    profile = RequestProfile(api="chat", model=None, prompt_tokens=1_010_000, output_budget=32_768,
                             budget_explicit=False, modalities=frozenset({"text"}), thinking_mode="enabled",
                             stream=False)
    choice = choose(profile)
    assert choice.pool == EXTENDED and choice.reason == "clamped"


def test_an_image_goes_to_a_pool_that_takes_images(counter: TokenCounter) -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": PNG_1X1}}]}]}
    profile = classify(body, "chat", CFG, counter)
    choice = choose(profile)
    assert choice.pool == REPOSITORY and "image" in choice.pool.modalities
    assert all("image" in p.modalities for p in choice.candidates)


# ---------------------------------------------------------------------------------------------------------------
# Saturation, spill and forcing


def test_spill_upward_skips_saturated_pools(counter: TokenCounter) -> None:
    profile = chat_profile(counter, "hello")
    one = choose(profile, saturated=frozenset({"interactive"}))
    assert one.pool == REPOSITORY and one.reason == "spill:interactive" and names(one) == ["repository", "extended"]
    two = choose(profile, saturated=frozenset({"interactive", "repository"}))
    assert two.pool == EXTENDED and two.reason == "spill:interactive"
    everything = choose(profile, saturated=frozenset({"interactive", "repository", "extended"}))
    assert everything.pool == INTERACTIVE and everything.reason == "all_saturated"


def test_never_spills_downward(counter: TokenCounter, text_of: Any) -> None:
    profile = chat_profile(counter, text_of(60_000))
    choice = choose(profile, saturated=frozenset({"repository"}))
    assert choice.pool == EXTENDED and "interactive" not in names(choice)
    stuck = choose(profile, saturated=frozenset({"repository", "extended"}))
    assert stuck.pool == REPOSITORY and "interactive" not in names(stuck)


def test_a_pool_that_may_not_spill_keeps_its_requests(counter: TokenCounter) -> None:
    pools = [INTERACTIVE.model_copy(update={"spill_upward": False}), REPOSITORY, EXTENDED]
    choice = choose_pool(chat_profile(counter, "hello"), pools, CFG, saturated=frozenset({"interactive"}))
    assert choice.pool.name == "interactive" and names(choice) == ["interactive"]


def test_pools_given_in_any_order_are_used_smallest_first(counter: TokenCounter) -> None:
    choice = choose_pool(chat_profile(counter, "hello"), [EXTENDED, INTERACTIVE, REPOSITORY], CFG)
    assert names(choice) == ["interactive", "repository", "extended"]


def test_forced_pool(counter: TokenCounter, text_of: Any) -> None:
    short = chat_profile(counter, "hello")
    forced = choose(short, forced="extended", saturated=frozenset({"extended"}))
    assert forced.pool == EXTENDED and forced.reason == "forced" and names(forced) == ["extended"]
    too_big = chat_profile(counter, text_of(60_000), max_tokens=1000)
    with pytest.raises(RequestRejected) as info:
        choose(too_big, forced="interactive")
    assert info.value.code == "context_length_exceeded" and "x-m3gate-pool" in info.value.message
    assert "32,768" in info.value.message
    with pytest.raises(RequestRejected) as unknown:
        choose(short, forced="huge")
    assert unknown.value.status == 400 and unknown.value.param == "x-m3gate-pool"
    assert "'interactive'" in unknown.value.message  # says which pools exist


def test_forced_pool_must_take_the_modality(counter: TokenCounter) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_1X1}}]}]}
    with pytest.raises(RequestRejected) as info:
        choose(classify(body, "chat", CFG, counter), forced="interactive")
    assert info.value.code == "unsupported_modality" and "image" in info.value.message


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_no_pool_holds_it(counter: TokenCounter) -> None:
    """~1.3M tokens (' word' is one token): the error gives both sizes, the largest context, and what to do."""
    profile = chat_profile(counter, " word" * 1_300_000, max_tokens=2_000)
    assert profile.prompt_tokens == pytest.approx(1_300_000, rel=0.02)
    with pytest.raises(RequestRejected) as info:
        choose(profile)
    exc = info.value
    assert (exc.status, exc.code, exc.param) == (400, "context_length_exceeded", "messages")
    assert f"{profile.prompt_tokens:,}" in exc.message and "2,000" in exc.message
    assert "1,048,576" in exc.message and "Shorten" in exc.message


def test_an_explicit_budget_too_large_says_to_lower_it(counter: TokenCounter) -> None:
    profile = chat_profile(counter, "hello", max_completion_tokens=2_000_000)
    with pytest.raises(RequestRejected) as info:
        choose(profile)
    assert info.value.param == "max_completion_tokens" and "Lower max_completion_tokens" in info.value.message


def test_image_without_an_image_pool(counter: TokenCounter) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_1X1}}]}]}
    profile = classify(body, "chat", CFG, counter)
    with pytest.raises(RequestRejected) as info:
        choose_pool(profile, [INTERACTIVE, INTERACTIVE.model_copy(update={"name": "big", "max_model_len": 131_072})], CFG)
    exc = info.value
    assert exc.code == "unsupported_modality" and "1 image" in exc.message and "no pool" in exc.message


# ---------------------------------------------------------------------------------------------------------------
# Near a boundary: ask for the exact count, then decide with it


def test_boundary_band_asks_for_an_exact_count(counter: TokenCounter, text_of: Any) -> None:
    disabled = {"chat_template_kwargs": {"thinking_mode": "disabled"}}  # 4,096 of output
    near_below = chat_profile(counter, text_of(26_500), **disabled)  # ~31.4K of 32K: an exact count might not fit
    choice = choose(near_below)
    assert choice.pool == INTERACTIVE and choice.needs_exact_count
    just_above = chat_profile(counter, text_of(28_500), **disabled)  # ~33.5K: an exact count might fit 32K
    above = choose(just_above)
    assert above.pool == REPOSITORY and above.needs_exact_count
    # the replica's /tokenize says 27,000: it fits the interactive pool, and nothing more is asked
    recounted = choose(with_exact_prompt_tokens(just_above, 27_000))
    assert recounted.pool == INTERACTIVE and not recounted.needs_exact_count
    far = chat_profile(counter, text_of(10_000), **disabled)
    assert not choose(far).needs_exact_count
    off = choose_pool(near_below, POOLS, CFG.model_copy(update={"exact_count_near_boundary": False}))
    assert not off.needs_exact_count


def test_only_the_prompt_is_uncertain(counter: TokenCounter) -> None:
    """A short prompt with max_tokens close to the limit: no exact count could change the decision, none is asked."""
    choice = choose(chat_profile(counter, "Write a long story.", max_tokens=31_000))
    assert choice.pool == INTERACTIVE and not choice.needs_exact_count


def test_just_over_the_largest_pool_is_counted_before_being_refused() -> None:
    profile = RequestProfile(api="chat", model=None, prompt_tokens=1_040_000, output_budget=8_000,
                             budget_explicit=True, modalities=frozenset({"text"}), thinking_mode="adaptive",
                             stream=False, estimate_exact=False)
    choice = choose(profile)
    assert choice.pool == EXTENDED and choice.needs_exact_count and choice.reason == "near_limit"
    with pytest.raises(RequestRejected):  # the exact count confirms it: now it is refused
        choose(with_exact_prompt_tokens(profile, 1_045_000))
    assert choose(with_exact_prompt_tokens(profile, 1_000_000)).pool == EXTENDED


def test_the_exact_count_carries_no_safety_margin() -> None:
    """32,000 counted by the model + 768 of output is exactly 32K: it fits, although 3% margin would not."""
    profile = RequestProfile(api="chat", model=None, prompt_tokens=32_000, output_budget=768, budget_explicit=True,
                             modalities=frozenset({"text"}), thinking_mode="adaptive", stream=False)
    assert choose(profile).pool == REPOSITORY
    assert choose(with_exact_prompt_tokens(profile, 32_000)).pool == INTERACTIVE


def test_a_sampled_estimate_widens_the_band_by_its_error_bound() -> None:
    """22,000 estimated + 4,096 of output: 10% more (28.7K) still fits 32K, so an exact estimate is not recounted;
    the same number sampled with a ±30% bound (combined with the band: ±31.6%) could be 29K of prompt, past 32K
    with its output: recounted. The two combine in quadrature: ±3% barely widens the band."""
    def profile(error: float) -> RequestProfile:
        return RequestProfile(api="chat", model=None, prompt_tokens=22_000, output_budget=4_096, budget_explicit=True,
                              modalities=frozenset({"text"}), thinking_mode="disabled", stream=False,
                              estimate_exact=error == 0.0, estimate_error=error)

    assert choose(profile(0.0)).pool == INTERACTIVE and not choose(profile(0.0)).needs_exact_count
    widened = choose(profile(0.3))
    assert widened.pool == INTERACTIVE and widened.needs_exact_count
    assert not choose(profile(0.03)).needs_exact_count
    assert with_exact_prompt_tokens(profile(0.3), 22_500).estimate_error == 0.0


@pytest.mark.parametrize("limit_pool", [INTERACTIVE, REPOSITORY])
def test_near_a_boundary_sampling_never_changes_the_pool_unnoticed(limit_pool: PoolConfig) -> None:
    """Chats of mixed text from 80% to 120% of a pool's limit, classified from a sample and from a full count: either
    both choose the same pool, or the sampled one asks for the exact count (which then decides as the full one)."""
    corpus = TextCorpus()
    exact_cfg = CFG.model_copy(update={"full_count_below_chars": 10**9})
    sampled_counter = TokenCounter(CFG)
    exact_counter = TokenCounter(exact_cfg)
    disabled = {"chat_template_kwargs": {"thinking_mode": "disabled"}}
    rng = random.Random(limit_pool.name)
    limit = limit_pool.max_model_len - 4_096
    for step in range(9):
        n_tokens = int(limit * (0.8 + 0.05 * step))
        text = text_with_tokens(corpus, "mixed", n_tokens, rng)
        body = {"messages": [{"role": "user", "content": text}], **disabled}
        sampled = classify(body, "chat", CFG, sampled_counter)
        exact = classify(body, "chat", exact_cfg, exact_counter)
        assert not sampled.estimate_exact and exact.estimate_exact
        by_sample, by_count = choose(sampled), choose(exact)
        assert by_sample.pool == by_count.pool or by_sample.needs_exact_count, (n_tokens, sampled, exact)


@pytest.mark.parametrize("error", [-0.06, -0.03, 0.0, 0.05, 0.14])
def test_the_plain_band_already_recounts_whatever_an_error_could_move(error: float) -> None:
    """Why the band needs only a quadrature widening: for an estimate off by -6% to +14%, the pool chosen from it
    differs from the pool chosen from the true count only when the plain band asks for an exact count anyway."""
    cfg = CFG.model_copy(update={"exact_count_near_boundary": True})
    for true_prompt in range(20_000, 160_000, 250):
        for budget in (16, 4_096, 16_384):
            def profile(tokens: int) -> RequestProfile:
                return RequestProfile(api="chat", model=None, prompt_tokens=tokens, output_budget=budget,
                                      budget_explicit=True, modalities=frozenset({"text"}),
                                      thinking_mode="adaptive", stream=False)
            truth = choose_pool(profile(true_prompt), POOLS, cfg)
            estimate = choose_pool(profile(round(true_prompt * (1 + error))), POOLS, cfg)
            assert estimate.pool == truth.pool or estimate.needs_exact_count, (true_prompt, budget)
