"""Simulator tokenization: stable prefixes, cheap huge prompts, chat rendering, and a real HF tokenizer.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pools.sim.prefix_cache import block_hashes
from pools.sim.tokenizer import ByteChunkTokenizer, HFTokenizer, normalize_messages, render_minimax

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_equal_text_prefixes_give_equal_token_prefixes() -> None:
    tok = ByteChunkTokenizer()
    shared = "system prompt " * 40
    a = tok.encode(shared + "question one", False)
    b = tok.encode(shared + "another question entirely", False)
    n = len(shared.encode()) // 4
    assert a.ids()[:n] == b.ids()[:n] and a.ids() != b.ids()
    assert block_hashes(a, 16)[: n // 16] == block_hashes(b, 16)[: n // 16]


def test_cache_salt_separates_equal_prompts() -> None:
    tokens = ByteChunkTokenizer().encode("x" * 1000, False)
    assert block_hashes(tokens, 16, "tenant-a")[0] != block_hashes(tokens, 16, "tenant-b")[0]
    assert block_hashes(tokens, 16)[0] == block_hashes(tokens, 16)[0]


def test_a_million_token_prompt_is_counted_and_hashed_quickly() -> None:
    text = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB
    started = time.perf_counter()
    tokens = ByteChunkTokenizer().encode(text, False)
    hashes = block_hashes(tokens, 128)
    elapsed = time.perf_counter() - started
    assert tokens.count >= 1_000_000 and len(hashes) == tokens.count // 128
    assert elapsed < 0.5


def test_chat_rendering_keeps_earlier_turns_as_a_prefix() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    one = render_minimax(normalize_messages(turn1).messages, None, False, False, {})
    two = render_minimax(normalize_messages(turn2).messages, None, True, False, {})
    assert two.startswith(one) and two.endswith("]~b]ai\n")


def test_content_parts_join_with_newlines_and_media_are_collected() -> None:
    chat = normalize_messages([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}}, {"type": "text", "text": "b"}]}])
    assert chat.messages[0]["content"] == "a\nb"
    assert [(m.kind, m.key) for m in chat.media] == [("image", "u1")]


def test_tool_call_arguments_are_parsed_for_templates() -> None:
    chat = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}])
    assert chat.messages[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the gateway routes requests to replicas"] * 50 + ["hello world, how are you"] * 50,
                            trainer)
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    return directory


def test_hf_tokenizer_renders_the_chat_template_and_counts_with_tokenizer_json(hf_dir: Path) -> None:
    from tokenizers import Tokenizer

    hf = HFTokenizer(hf_dir)
    messages = [{"role": "system", "content": "route well"}, {"role": "user", "content": "hello world"}]
    text = hf.render_chat(normalize_messages(messages).messages, tools=None, add_generation_prompt=True,
                          continue_final_message=False, template_kwargs={})
    assert text == "<s><|system|>route well</s>\n<|user|>hello world</s>\n<|assistant|>"
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text, add_special_tokens=False)
    tokens = hf.encode(text, False)
    assert tokens.count == len(reference.ids) and tokens.ids() == reference.ids
    assert tokens.token_strs() == reference.tokens


def test_byte_chunk_ids_handed_out_decode_back_to_their_text() -> None:
    tok = ByteChunkTokenizer()
    text = "héllo wörld, the gateway routes requests"
    tokens = tok.encode(text, False)
    tok.learn(tokens)
    assert tok.decode(tokens.ids()) == text
    assert tok.decode([100, 10**12]) == "d", "unknown ids read as their own bytes; ids past the vocabulary are skipped"
    assert tok.max_chars_per_token == 4 and tok.content_format == "string"


def test_messages_keep_only_the_fields_vllm_passes_to_templates() -> None:
    chat = normalize_messages([
        {"role": "user", "content": None, "extra": 1},
        {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": []},
        {"role": "assistant", "content": "b", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
    ], openai_parts=True)
    user, no_alias, call, tool = chat.messages
    assert user == {"role": "user", "content": []}
    assert no_alias == {"role": "assistant", "content": [{"type": "text", "text": "a"}]}, "reasoning_content dropped"
    assert call["tool_calls"][0]["function"]["arguments"] == {}, "unparsable arguments become {}"
    assert tool == {"role": "tool", "content": "x\ny", "tool_call_id": "1"}
    aliased = normalize_messages([{"role": "assistant", "content": "a", "reasoning_content": "r"}],
                                 reasoning_alias=True).messages[0]
    assert aliased == {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}


def test_content_format_is_detected_from_the_template_ast() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pools.sim.tokenizer import detect_content_format

    env = ImmutableSandboxedEnvironment()
    assert detect_content_format(env, CHAT_TEMPLATE) == "string"
    direct = "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
    assert detect_content_format(env, direct) == "openai"
    via_macro = ("{% macro t(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
                 "{% for m in messages %}{{ t(m.content) }}{% endfor %}")
    assert detect_content_format(env, via_macro) == "openai"


def test_hf_continue_final_message_and_developer_role(hf_dir: Path) -> None:
    hf = HFTokenizer(hf_dir)
    messages = normalize_messages([{"role": "user", "content": "hi"}, {"role": "developer", "content": "be brief"},
                                   {"role": "assistant", "content": "hello wor"}]).messages
    text = hf.render_chat(messages, tools=None, add_generation_prompt=False, continue_final_message=True,
                          template_kwargs={})
    assert text == "<s><|system|>be brief</s>\n<|user|>hi</s>\n<|assistant|>hello wor"
    from tokenizers import Tokenizer

    ids = hf.encode("hello world", False).ids()
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert hf.decode([*ids, 10**6]) == reference.decode(ids, skip_special_tokens=False)
