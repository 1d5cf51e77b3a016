"""vLLM's shapes as the gateway writes and reads them (policies/vllm_wire.py)."""

from __future__ import annotations

import orjson

from policies.vllm_wire import PREFILL_KV_PARAMS, decode_body, prefill_body, tokenize_body, usage_counts, usage_of

MODEL = "MiniMaxAI/MiniMax-M3"


def test_usage_is_read_in_each_apis_shape() -> None:
    chat = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}
    responses = {"input_tokens": 100, "output_tokens": 7, "input_tokens_details": {"cached_tokens": 64}}
    # Anthropic: input_tokens exclude cache reads and writes; the prompt is all three
    messages = {"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 64,
                "cache_creation_input_tokens": 16}
    assert usage_counts(chat) == usage_counts(responses) == usage_counts(messages) == (100, 7, 64)
    assert usage_counts({"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": None}) == (9, 1, 0)
    assert usage_counts(None) == usage_counts({}) == (0, 0, 0)
    assert usage_counts({"prompt_tokens": "x", "completion_tokens": -3}) == (0, 0, 0)  # nonsense counts as nothing


def test_usage_of_a_complete_answer() -> None:
    assert usage_of(orjson.dumps({"id": "x", "usage": {"prompt_tokens": 3}})) == {"prompt_tokens": 3}
    assert usage_of(b"not json") is None
    assert usage_of(b"[1, 2]") is None
    assert usage_of(b'{"usage": 5}') is None


def test_tokenize_renders_what_the_generate_request_will() -> None:
    chat = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 9,
            "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True, "stream": True}
    assert tokenize_body(chat, "chat", MODEL) == {
        "model": MODEL, "messages": chat["messages"], "tools": [], "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True}
    assert tokenize_body({"prompt": "x", "add_special_tokens": False, "max_tokens": 3}, "completions", MODEL) == {
        "model": MODEL, "prompt": "x", "add_special_tokens": False}
    assert tokenize_body({"input": "x"}, "responses", MODEL) is None  # /tokenize has no form for it


def test_prefill_then_decode_bodies() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 500, "min_tokens": 10}
    prefill = prefill_body(body)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "min_tokens" not in prefill  # vLLM refuses min_tokens above max_tokens
    assert prefill["kv_transfer_params"] == PREFILL_KV_PARAMS and prefill["kv_transfer_params"] is not PREFILL_KV_PARAMS
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    decode = decode_body(body, params)
    assert decode["kv_transfer_params"] is params and decode["min_tokens"] == 10 and decode["max_tokens"] == 500
    assert "kv_transfer_params" not in body  # the client's body is left as it came


def test_tokenize_ids_are_read_as_bytes_and_a_malformed_answer_gives_none() -> None:
    from policies.vllm_wire import tokenize_ids

    assert tokenize_ids(b'{"count":3,"max_model_len":8192,"tokens":[1,22,333],"token_strs":null}') == b"1,22,333"
    assert tokenize_ids(b'{"count": 2, "tokens": [ 4, 5 ]}') == b"4, 5"
    for malformed in (b"[1,2,3]", b"not json", b'{"count":3}', b'{"tokens":[]}', b'{"tokens":["a"]}',
                      b'{"tokens":[1,,2]}', b'{"tokens":[1,2'):
        assert tokenize_ids(malformed) is None, malformed
