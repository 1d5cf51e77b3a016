"""GET/POST endpoints other than generation: /v1/models, /health, /version, /tokenize, /detokenize."""

from __future__ import annotations

import httpx

from tests.contract.support import SERVED_MODEL, VLLM_VERSION, Backend, LocalTokenizer, unique_words

MODEL_CARD_KEYS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
PERMISSION_KEYS = {
    "id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs", "allow_search_indices",
    "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking",
}  # fmt: skip
TOKENIZE_KEYS = {"count", "max_model_len", "tokens", "token_strs"}


async def test_models_card_carries_max_model_len(client: httpx.AsyncClient, backend: Backend) -> None:
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert set(card) == MODEL_CARD_KEYS
    assert card["id"] == SERVED_MODEL
    assert card["object"] == "model"
    assert card["owned_by"] == "vllm"
    assert card["parent"] is None
    assert card["max_model_len"] == backend.max_model_len
    assert isinstance(card["created"], int) and isinstance(card["root"], str) and card["root"]
    [permission] = card["permission"]
    assert set(permission) == PERMISSION_KEYS
    assert permission["object"] == "model_permission"
    assert permission["id"].startswith("modelperm-")


async def test_health_is_empty_200(client: httpx.AsyncClient) -> None:
    response = await client.get("/health")
    assert response.status_code == 200
    assert response.content == b""


async def test_version(client: httpx.AsyncClient) -> None:
    response = await client.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": VLLM_VERSION}


async def test_tokenize_completion_form_matches_the_tokenizer(
    client: httpx.AsyncClient, backend: Backend, oracle: LocalTokenizer
) -> None:
    text = unique_words(40) + "\n  tabs\tand ünïcödé → 42"
    response = await client.post("/tokenize", json={"model": SERVED_MODEL, "prompt": text})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == TOKENIZE_KEYS
    assert body["tokens"] == oracle.ids(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == backend.max_model_len
    assert body["token_strs"] is None

    with_strs = (await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
    assert with_strs["token_strs"] == oracle.strs(text)


async def test_tokenize_chat_form_renders_the_template(client: httpx.AsyncClient, oracle: LocalTokenizer) -> None:
    user_text = unique_words(12)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user_text}]
    body = (await client.post("/tokenize", json={"model": SERVED_MODEL, "messages": messages})).json()
    assert set(body) == TOKENIZE_KEYS
    assert body["count"] == len(body["tokens"])
    assert body["tokens"][0] == oracle.bos_id, "the template starts with BOS; add_special_tokens adds nothing more"
    rendered = oracle.decode(body["tokens"])
    assert user_text in rendered and "Be brief." in rendered
    assert rendered.endswith("]~b]ai\n"), "add_generation_prompt defaults to true"

    no_prompt = (await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
    assert oracle.decode(no_prompt["tokens"]).endswith("[e~[\n")
    assert no_prompt["count"] < body["count"]

    thinking = (
        await client.post(
            "/tokenize", json={"messages": messages, "chat_template_kwargs": {"thinking_mode": "enabled"}}
        )
    ).json()
    assert oracle.decode(thinking["tokens"]).endswith("]~b]ai\n<mm:think>")


async def test_tokenize_chat_form_with_tools(client: httpx.AsyncClient, oracle: LocalTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "weather?"}]
    with_tools = (await client.post("/tokenize", json={"messages": messages, "tools": tools})).json()
    without = (await client.post("/tokenize", json={"messages": messages})).json()
    assert with_tools["count"] > without["count"]
    assert "get_weather" in oracle.decode(with_tools["tokens"])


async def test_tokenize_rejects_both_generation_flags(client: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "add_generation_prompt": True,
        "continue_final_message": True,
    }
    response = await client.post("/tokenize", json=body)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


async def test_tokenize_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"


async def test_detokenize_round_trips(client: httpx.AsyncClient, oracle: LocalTokenizer) -> None:
    text = unique_words(20)
    response = await client.post("/detokenize", json={"model": SERVED_MODEL, "tokens": oracle.ids(text)})
    assert response.status_code == 200
    assert response.json() == {"prompt": text}


async def test_detokenize_keeps_special_tokens_and_skips_unknown_ids(
    client: httpx.AsyncClient, oracle: LocalTokenizer
) -> None:
    ids = [oracle.bos_id, *oracle.ids("alpha bravo")[1:], oracle.eos_id]
    assert (await client.post("/detokenize", json={"tokens": ids})).json() == {"prompt": oracle.decode(ids)}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
    assert (await client.post("/detokenize", json={"tokens": [10**9]})).json() == {"prompt": ""}
    unknown_model = await client.post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["type"] == "NotFoundError"


async def test_tokenize_empty_conversation_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/tokenize", json={"messages": []})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Cannot apply chat template to an empty conversation. Provide at least one message.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
