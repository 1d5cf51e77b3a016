"""Prefix identity: requests that share a prompt prefix share leading block hashes, and nothing else does."""

from __future__ import annotations

import random
import string

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.prefix import chain_hashes, prefix_blocks, prefix_seed, render_prefix

MODEL = "MiniMaxAI/MiniMax-M3"


def _text(n_chars: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choices(string.ascii_letters + "     .,\n", k=n_chars))


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


SYSTEM = _text(5000, 1)


def _chat(user: str, system: str = SYSTEM, **extra: object) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, **extra}


# -- chaining -----------------------------------------------------------------------------------------------------


def test_only_whole_blocks_are_hashed() -> None:
    assert len(chain_hashes(b"a" * 1023, seed=1, block_bytes=512)) == 1
    assert len(chain_hashes(b"a" * 1024, seed=1, block_bytes=512)) == 2
    assert chain_hashes(b"a" * 511, seed=1, block_bytes=512) == ()


def test_each_block_hash_covers_its_parent() -> None:
    """Two identical blocks at different depths hash differently, and block k is xxh3_64(block, seed=hash k-1)."""
    hashes = chain_hashes(b"z" * 1536, seed=7, block_bytes=512)
    assert len(set(hashes)) == 3
    assert hashes[0] == xxhash.xxh3_64_intdigest(b"z" * 512, 7)
    assert hashes[2] == xxhash.xxh3_64_intdigest(b"z" * 512, hashes[1])


def test_one_byte_change_in_block_k_changes_k_and_every_later_hash() -> None:
    data = bytearray(_text(512 * 10, 2).encode())
    base = chain_hashes(bytes(data), seed=3)
    for k in (0, 4, 9):
        changed = bytearray(data)
        changed[k * 512 + 100] ^= 0x01
        other = chain_hashes(bytes(changed), seed=3)
        assert other[:k] == base[:k]
        assert all(x != y for x, y in zip(other[k:], base[k:], strict=True))


# -- identity of requests -----------------------------------------------------------------------------------------


def test_same_prefix_same_leading_hashes_different_suffix_diverges() -> None:
    a = prefix_blocks(_chat(_text(3000, 10)), "chat", MODEL)
    b = prefix_blocks(_chat(_text(3000, 11)), "chat", MODEL)
    shared = _common_prefix(a, b)
    assert len(SYSTEM) // 512 - 1 <= shared <= (len(SYSTEM) + 64) // 512  # the system prompt's blocks, not more
    assert shared < min(len(a), len(b))


def test_model_and_cache_salt_change_every_hash() -> None:
    body = _chat(_text(3000, 12))
    base = prefix_blocks(body, "chat", MODEL)
    for other in (
        prefix_blocks(body, "chat", "another/model"),
        prefix_blocks({**body, "cache_salt": "tenant-a"}, "chat", MODEL),
    ):
        assert len(other) == len(base) > 0
        assert not set(other) & set(base)
    salted_a = prefix_blocks({**body, "cache_salt": "tenant-a"}, "chat", MODEL)
    salted_b = prefix_blocks({**body, "cache_salt": "tenant-b"}, "chat", MODEL)
    assert not set(salted_a) & set(salted_b)
    assert prefix_seed(MODEL, "") == prefix_seed(MODEL, None)  # vLLM rejects an empty salt; treat it as none


def test_multi_turn_conversation_extends_its_earlier_turns() -> None:
    turn1 = _chat(_text(4000, 13))
    turn2 = {
        **turn1,
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": _text(2000, 14)},
            {"role": "user", "content": _text(3000, 15)},
        ],
    }
    first, second = prefix_blocks(turn1, "chat", MODEL), prefix_blocks(turn2, "chat", MODEL)
    assert second[: len(first)] == first


def test_tools_come_after_the_system_prompt_so_a_tool_change_keeps_it() -> None:
    tools_a = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    tools_b = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}]
    question = _text(2000, 24)
    a = prefix_blocks(_chat(question, tools=tools_a), "chat", MODEL)
    b = prefix_blocks(_chat(question, tools=tools_b), "chat", MODEL)
    assert _common_prefix(a, b) >= len(SYSTEM) // 512 - 1
    assert a != b
    # tool schemas are compared by content, not by key order
    reordered = [{"function": {"parameters": {"type": "object"}, "name": "read"}, "type": "function"}]
    assert prefix_blocks(_chat(question, tools=reordered), "chat", MODEL) == a


def test_images_are_identified_by_their_data_not_fetched_and_not_expanded() -> None:
    def with_image(url: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": _text(3000, 16)}]
        return {"messages": [{"role": "user", "content": content}]}

    big = "data:image/png;base64," + "A" * 2_000_000
    a = prefix_blocks(with_image(big), "chat", MODEL)
    assert len(a) < 10  # two megabytes of base64 are one short reference, not 4000 blocks
    assert prefix_blocks(with_image(big), "chat", MODEL) == a
    assert prefix_blocks(with_image(big[:-1] + "B"), "chat", MODEL)[0] != a[0]
    assert prefix_blocks(with_image("https://example.com/cat.png"), "chat", MODEL)[0] != a[0]


def test_string_content_equals_a_single_text_part() -> None:
    text = _text(2048, 17)
    as_string = {"messages": [{"role": "user", "content": text}]}
    as_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert prefix_blocks(as_string, "chat", MODEL) == prefix_blocks(as_parts, "chat", MODEL) != ()


def test_responses_instructions_and_anthropic_system_line_up_with_chat_system() -> None:
    """The same system prompt through /v1/responses and /v1/messages gives the same leading blocks as chat."""
    chat = prefix_blocks(_chat("question one"), "chat", MODEL)
    responses = prefix_blocks({"instructions": SYSTEM, "input": "question two"}, "responses", MODEL)
    anthropic = prefix_blocks(
        {"system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
         "messages": [{"role": "user", "content": "question three"}]},
        "messages", MODEL,
    )  # fmt: skip
    n = len(SYSTEM) // 512 - 1
    assert n > 5
    assert chat[:n] == responses[:n] == anthropic[:n]


def test_responses_input_items_and_previous_response_are_part_of_identity() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": _text(3000, 18)}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": _text(2000, 19)},
    ]
    base = prefix_blocks({"instructions": "be brief", "input": items}, "responses", MODEL)
    assert len(base) >= 9
    changed = [*items[:2], {**items[2], "output": _text(2000, 20)}]
    assert prefix_blocks({"instructions": "be brief", "input": changed}, "responses", MODEL)[:5] == base[:5]
    chained = prefix_blocks(
        {"instructions": "be brief", "previous_response_id": "resp_1", "input": items}, "responses", MODEL
    )
    assert chained[0] != base[0]


def test_completions_text_token_ids_and_batches() -> None:
    text = _text(4096, 21)
    assert len(prefix_blocks({"prompt": text}, "completions", MODEL)) == 8
    ids = list(range(1000))
    by_ids = prefix_blocks({"prompt": ids}, "completions", MODEL)
    assert len(by_ids) == 1000 // 128  # 4 bytes per token id: a 512-byte block is exactly 128 tokens
    assert prefix_blocks({"prompt": [ids, [1, 2]]}, "completions", MODEL) == by_ids
    assert prefix_blocks({"prompt": [text, "other"]}, "completions", MODEL) == prefix_blocks(
        {"prompt": text}, "completions", MODEL
    )


def test_utf8_bytes_make_cjk_blocks_comparable_to_english_ones() -> None:
    """2,000 CJK characters (~2,000 tokens) give ~12 blocks, not the 4 a 512-character cut would give."""
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(2000))
    assert len(prefix_blocks({"prompt": cjk}, "completions", MODEL)) == (2000 * 3) // 512


def test_cache_control_hints_do_not_change_identity() -> None:
    plain = {"system": SYSTEM, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi " * 400}]}]}
    hinted = {
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi " * 400, "cache_control": {"type": "ephemeral"}}]}
        ],
    }
    assert prefix_blocks(plain, "messages", MODEL) == prefix_blocks(hinted, "messages", MODEL)


# -- robustness ---------------------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=40,
)
_keys = st.sampled_from(["messages", "prompt", "input", "instructions", "system", "tools", "cache_salt", "role",
                         "content", "type", "previous_response_id"])  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(_keys, _json, max_size=6), api=st.sampled_from(["chat", "completions", "responses",
                                                                              "messages", "bogus"]))  # fmt: skip
def test_odd_json_never_raises(body: dict, api: str) -> None:
    hashes = prefix_blocks(body, api, MODEL)
    assert isinstance(hashes, tuple)
    assert all(isinstance(h, int) for h in hashes)


def test_odd_shapes_render_what_they_can() -> None:
    odd = {"messages": [{"role": 5, "content": {"nested": ["x" * 600]}}, "not a dict", None, {"content": [1, 2.5]}]}
    assert len(prefix_blocks(odd, "chat", MODEL)) == 1
    assert prefix_blocks({"messages": "x" * 2000}, "chat", MODEL)  # a bare string still has an identity
    assert prefix_blocks({"prompt": [2**70, 1]}, "completions", MODEL) == ()  # too short, but no OverflowError
    assert prefix_blocks("not a dict", "chat", MODEL) == ()  # type: ignore[arg-type]
    deep: object = "x" * 1000
    for _ in range(5000):
        deep = [deep]
    deep_turns = [{"role": "user", "content": deep}, {"role": "user", "content": "y" * 1100}]
    assert len(prefix_blocks({"messages": deep_turns}, "chat", MODEL)) == 2  # the turn after it still counts
    lone_surrogate = {"messages": [{"role": "user", "content": "\ud800" * 300}]}
    assert len(prefix_blocks(lone_surrogate, "chat", MODEL)) == 1
    assert render_prefix({"prompt": "abc"}, "no-such-api") == b""


# -- speed --------------------------------------------------------------------------------------------------------


def test_a_1m_token_prompt_hashes_every_full_block_and_its_tail_changes_only_the_last() -> None:
    """A 1M-token prompt (the extended pool's largest) is hashed whole: one hash per 512 characters, and a change in
    its last block changes only the last hash (the chain is not cut short on long prompts). Its cost is measured by
    `python -m loadtests.bench.hotpath` (rows "prefix_blocks, ..."), not timed here."""
    text = _text(4_000_000, 23)
    blocks = prefix_blocks({"messages": [{"role": "user", "content": text}]}, "chat", MODEL)
    assert len(blocks) == 4_000_000 // 512
    edited = text[:-300] + ("x" if text[-300] != "x" else "y") + text[-299:]
    other = prefix_blocks({"messages": [{"role": "user", "content": edited}]}, "chat", MODEL)
    assert _common_prefix(blocks, other) == len(blocks) - 1


@pytest.mark.parametrize("block", [512, 100, 4096])
def test_long_parts_hash_in_place_as_the_joined_rendering_would(block: int) -> None:
    """prefix_blocks hashes long messages where they lie instead of joining the rendering: the same hashes, whatever
    the lengths of the long and short pieces around block boundaries (ASCII, CJK, tool calls between them)."""
    rng = random.Random(block)
    for _ in range(20):
        messages: list[dict[str, object]] = [{"role": "system", "content": "be brief"}]
        for i in range(rng.randint(1, 12)):
            size = rng.choice([0, 1, 511, 512, 513, 16_383, 16_384, 16_385, 40_000, 100_003])
            text = rng.choice(["a", "é", "网", "x y "]) * (size // 2 + 1)
            messages.append({"role": rng.choice(["user", "assistant", "tool"]), "content": text[:size]})
            if i % 3 == 1:
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}" * i}}]})
        body = {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}
        expected = chain_hashes(render_prefix(body, "chat"), prefix_seed("m"), block)
        assert prefix_blocks(body, "chat", "m", block) == expected
