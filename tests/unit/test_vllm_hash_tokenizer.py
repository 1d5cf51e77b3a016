"""Gateway-side exact tokenization (pools/tokenizer.py): the prompt token ids a replica would compute, from the
model folder's tokenizer and chat template, then vLLM's block hashes; off the event loop, in threads or a process."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from policies.vllm_hash import block_hashes
from pools.sim.tokenizer import HFTokenizer, normalize_messages
from pools.tokenizer import (
    HashSettings,
    LocalTokenizer,
    PromptHasher,
    ReplicaTokenizer,
    cut_text,
    exact_eligible,
    vllm_tool_dicts,
)

MODEL = "MiniMaxAI/MiniMax-M3"


@pytest.fixture(scope="module")
def local(tiny_tokenizer_dir: Path) -> LocalTokenizer:
    return LocalTokenizer(tiny_tokenizer_dir)


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "Be terse. " * 200},
                                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}], **extra}


def test_chat_token_ids_are_the_rendered_template_encoded_without_special_tokens(
    local: LocalTokenizer, tiny_tokenizer_dir: Path
) -> None:
    ref = HFTokenizer(tiny_tokenizer_dir)  # the renderer the contract suite checks against vLLM's /tokenize
    body = chat(chat_template_kwargs={"thinking_mode": "disabled"})
    messages = normalize_messages(
        body["messages"], openai_parts=ref.content_format == "openai", reasoning_alias=True  # type: ignore[arg-type]
    ).messages
    text = ref.render_chat(messages, tools=None, add_generation_prompt=True, continue_final_message=False,
                           template_kwargs={"thinking_mode": "disabled"})
    ids, cut = local.token_ids_sync(body, "chat")  # type: ignore[misc]
    assert not cut and ids == ref.encode(text, False).ids()
    assert local.token_ids_sync(chat(add_generation_prompt=False), "chat")[0] != ids  # type: ignore[index]


def test_completions_prompts_and_token_id_prompts(local: LocalTokenizer) -> None:
    text_ids, _ = local.token_ids_sync({"prompt": "hello world"}, "completions")  # type: ignore[misc]
    assert text_ids == local.encode("hello world", True)
    assert local.token_ids_sync({"prompt": [5, 6, 7]}, "completions") == ([5, 6, 7], False)
    assert local.token_ids_sync({"prompt": ["hello world"]}, "completions")[0] == text_ids  # type: ignore[index]


def test_only_requests_hashed_from_token_ids_alone_are_eligible() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert exact_eligible(chat(), "chat")
    assert not exact_eligible({"messages": [{"role": "user", "content": [image]}]}, "chat")
    assert not exact_eligible({"prompt_embeds": "..", "prompt": "x"}, "completions")
    assert not exact_eligible({"input": "hi"}, "responses") and not exact_eligible({"messages": []}, "chat")


def test_tools_are_reshaped_as_vllm_dumps_them() -> None:
    sent = [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "f"}}]
    assert vllm_tool_dicts(sent) == [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": {"type": "object"}}, "defer_loading": None}]
    assert list(vllm_tool_dicts(sent)[0]["function"]) == ["name", "description", "parameters"]  # type: ignore[index]
    assert vllm_tool_dicts(None) is None


def test_long_texts_are_cut_at_a_line_break() -> None:
    text = "line one\n" * 100
    assert cut_text(text, None) == (text, False)
    head, cut = cut_text(text, 95)
    assert cut and head == ("line one\n" * 10)[:-1] and len(head) <= 95  # cut just before the break


async def test_hashes_in_threads_and_in_a_process_agree_and_salt_changes_them(local: LocalTokenizer) -> None:
    settings = HashSettings(block_size=16)
    threaded = PromptHasher(local, settings, process_above_bytes=None)
    forked = PromptHasher(local, settings, process_above_bytes=0)
    try:
        body = chat()
        payload = orjson.dumps(body)
        expected = block_hashes(local.token_ids_sync(body, "chat")[0], 16)  # type: ignore[index]
        assert await threaded.hashes(payload, "chat") == expected
        assert await forked.hashes(payload, "chat") == expected
        salted = await threaded.hashes(orjson.dumps(chat(cache_salt="tenant-a")), "chat")
        assert salted != expected and len(salted) == len(expected)
        assert await threaded.hashes(b"not json", "chat") == () and threaded.skipped == 1
        assert await threaded.hashes({"input": "x"}, "responses") == ()
    finally:
        threaded.close()
        forked.close()


def test_cut_prompts_drop_their_last_block(local: LocalTokenizer) -> None:
    settings = HashSettings(block_size=16)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000 + "\n" + "tail " * 3000}]}
    full = block_hashes(local.token_ids_sync(body, "chat")[0], 16)  # type: ignore[index]
    short = LocalTokenizer(local.model_dir, max_chars=20000)
    hasher = PromptHasher(short, settings, process_above_bytes=None)
    try:
        head = hasher._local(body, "chat")  # noqa: SLF001 - the synchronous core
    finally:
        hasher.close()
    assert head is not None and 0 < len(head) < len(full) and head == full[: len(head)] and hasher.cut == 1


def test_replica_tokenize_payload_renders_what_the_generate_request_will() -> None:
    body = chat(tools=[{"type": "function", "function": {"name": "f"}}], chat_template_kwargs={"x": 1}, max_tokens=5)
    payload = ReplicaTokenizer.payload(body, "chat", MODEL)
    assert payload is not None and set(payload) == {"model", "messages", "tools", "chat_template_kwargs"}
    assert ReplicaTokenizer.payload({"prompt": "x", "add_special_tokens": False}, "completions", MODEL) == {
        "model": MODEL, "prompt": "x", "add_special_tokens": False}
