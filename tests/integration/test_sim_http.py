"""The simulated replica over real HTTP with the real `openai` SDK: the shapes and errors a gateway relays."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pools.sim.launcher import SimProcess, running_sims, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    proc = start_sim(4096, extra_args=["--speed", "20", "--seed", "7"])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(sim: SimProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def count_tokens(sim: SimProcess, messages: list[dict[str, object]], **extra: object) -> int:
    r = httpx.post(f"{sim.url}/tokenize", json={"model": MODEL, "messages": messages, **extra})
    r.raise_for_status()
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    return int(body["count"])


def test_non_streaming_chat_has_vllm_shape_and_consistent_usage(sim: SimProcess, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something about routers."}]
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=12, extra_headers={"X-Request-Id": "abc-123"},
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}, "ignore_eos": True})
    completion = resp.parse()
    assert completion.id == "chatcmpl-abc-123"
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == count_tokens(sim, messages, chat_template_kwargs={"thinking_mode": "disabled"})
    assert usage.total_tokens == usage.prompt_tokens + 12
    raw = json.loads(resp.text)
    assert raw["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert raw["choices"][0]["message"]["reasoning"] is None and "tool_calls" not in raw["choices"][0]["message"]


def test_streaming_chat_sends_role_reasoning_content_final_and_usage_chunks(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=20, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}, "ignore_eos": True})
    chunks = list(stream)
    first, *middle, final, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    reasoning = [c.choices[0].delta.model_extra.get("reasoning") for c in middle + [final]]
    kinds = ["r" if r else "c" for r in reasoning]
    assert kinds[0] == "r" and "c" in kinds and "".join(kinds) == "r" * kinds.count("r") + "c" * kinds.count("c")
    assert final.choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 20 == len(middle) + 1
    details = usage_chunk.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == kinds.count("r")


def test_disabled_thinking_never_reasons_and_adaptive_is_deterministic(client: openai.OpenAI) -> None:
    def reasoning_of(mode: str | None, text: str) -> str | None:
        kwargs = {"chat_template_kwargs": {"thinking_mode": mode}} if mode else {}
        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8,
                                           extra_body={**kwargs, "ignore_eos": True})
        return c.choices[0].message.model_extra.get("reasoning")

    assert all(reasoning_of("disabled", f"q{i}") is None for i in range(4))
    adaptive = [reasoning_of(None, f"question {i}") is not None for i in range(12)]
    assert any(adaptive) and not all(adaptive)
    assert adaptive == [reasoning_of(None, f"question {i}") is not None for i in range(12)]


def test_streamed_tool_call_has_header_then_arguments_and_finish_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
        tool_choice="required", stream=True, max_tokens=500,
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
    calls = [tc for c in stream for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    header, *rest = calls
    assert header.id and header.id.startswith("chatcmpl-tool-") and header.type == "function"
    assert header.function is not None and header.function.name == "get_weather"
    arguments = "".join((tc.function.arguments or "") for tc in [header, *rest] if tc.function)
    assert set(json.loads(arguments)) == {"city", "days"}


def test_non_streaming_tool_call_and_finish_reasons(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=500,
                                          tool_choice="required")
    assert auto.choices[0].finish_reason == "tool_calls"
    call = auto.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["days"], int)
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=500,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.tool_calls
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=50,
                                          tool_choice="none")
    assert not none.choices[0].message.tool_calls


def test_repeated_long_prompt_reports_whole_cached_blocks_and_metrics_move(sim: SimProcess,
                                                                        client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "cache me " * 500}]
    prompt_tokens = count_tokens(sim, messages)
    before = httpx.get(f"{sim.url}/metrics").text
    usages = []
    for _ in range(2):
        c = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
        usages.append(json.loads(c.text)["usage"])
    after = httpx.get(f"{sim.url}/metrics").text
    expected = (prompt_tokens - 1) // 128 * 128
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, expected]
    assert expected > 0

    def value(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total") == expected
    assert value(after, "vllm:prefix_cache_queries_total") - value(
        before, "vllm:prefix_cache_queries_total") == 2 * prompt_tokens


def test_completions_default_to_16_tokens_and_stream_text_chunks(client: openai.OpenAI) -> None:
    c = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert c.usage is not None and c.usage.completion_tokens == 16 and c.id.startswith("cmpl-")
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len(texts) == 5 and all(texts)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []


def test_prompt_plus_max_tokens_over_the_limit_is_clamped_not_rejected(sim: SimProcess,
                                                                      client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "x" * 14000}]
    prompt_tokens = count_tokens(sim, messages)
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4000,
                                       extra_body={"ignore_eos": True})
    assert c.usage is not None and c.usage.completion_tokens == 4096 - prompt_tokens


def test_errors_have_vllm_messages_and_sdk_exception_types(sim: SimProcess, client: openai.OpenAI) -> None:
    # 10,000 two-byte characters: under the character bound (4096 x 4), over the limit in 4-byte tokens.
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "é" * 10000}])
    err = too_long.value.body
    assert isinstance(err, dict) and err["param"] == "input_tokens" and err["type"] == "BadRequestError"
    assert err["message"] == (
        "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=4097)")

    # More characters than max_model_len x the longest vocabulary entry (4 for the built-in tokenizer): refused
    # before tokenizing, counted over the rendered prompt.
    with pytest.raises(openai.BadRequestError) as too_many_chars:
        client.completions.create(model=MODEL, prompt="y" * 40000, max_tokens=1)
    assert too_many_chars.value.body == {
        "message": "This model's maximum context length is 4096 tokens. However, your prompt contains 40000 "
                   "characters (more than 16384 characters, which is the upper bound for 4096 input tokens). Please "
                   "reduce the length of the input prompt. (parameter=input_text, value=40000)",
        "type": "BadRequestError", "param": "input_text", "code": 400}

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body == {"message": "The model `nope` does not exist. Valid aliases: MiniMaxAI/MiniMax-M3.",
                                  "type": "NotFoundError", "param": "model", "code": 404}

    with pytest.raises(openai.BadRequestError) as big_max:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
    assert "max_tokens=5000 cannot be greater than max_model_len=4096" in str(big_max.value)

    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert image.value.body == {"message": "MiniMaxAI/MiniMax-M3 is not a multimodal model",
                                "type": "BadRequestError", "param": None, "code": 400}

    with pytest.raises(openai.BadRequestError) as opts:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       stream_options={"include_usage": True})
    assert opts.value.body == {"message": "Stream options can only be defined when `stream=True`. "
                                          "(parameter=stream_options)",
                               "type": "BadRequestError", "param": "stream_options", "code": 400}


def test_raw_request_errors(sim: SimProcess) -> None:
    url = f"{sim.url}/v1/chat/completions"
    not_json = httpx.post(url, content=b"hello", headers={"content-type": "text/plain"})
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "Bad Request"
    assert "Only 'application/json' is allowed" in not_json.json()["error"]["message"]
    broken = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "JSON decode error" in broken.json()["error"]["message"]
    missing = httpx.post(url, json={"model": MODEL})
    body = missing.json()["error"]
    assert missing.status_code == 400 and body["message"].startswith("1 validation error:\n  ")
    assert body["param"] == "body.messages" and body["code"] == 400


def test_models_version_health_and_tokenize_forms(sim: SimProcess) -> None:
    models = httpx.get(f"{sim.url}/v1/models").json()
    card = models["data"][0]
    assert (card["id"], card["owned_by"], card["root"], card["max_model_len"]) == (MODEL, "vllm", MODEL, 4096)
    assert card["permission"][0]["object"] == "model_permission"
    assert httpx.get(f"{sim.url}/version").json() == {"version": "0.32.0"}
    health = httpx.get(f"{sim.url}/health")
    assert health.status_code == 200 and health.content == b""
    plain = httpx.post(f"{sim.url}/tokenize", json={"prompt": "abcdefgh", "return_token_strs": True}).json()
    assert plain["count"] == 2 and plain["token_strs"] == ["abcd", "efgh"]
    both = httpx.post(f"{sim.url}/tokenize", json={"messages": [{"role": "user", "content": "x"}],
                                                    "continue_final_message": True})
    assert both.status_code == 400


def test_metrics_exposition_names_labels_and_types(sim: SimProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{sim.url}/metrics").text)}
    common = {"engine": "0", "model_name": MODEL}
    expected_types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram"}
    for name, kind in expected_types.items():
        fam = families[name]
        assert fam.type == kind, name
        assert all({k: v for k, v in s.labels.items() if k in common} == common for s in fam.samples), name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]

    assert bounds("vllm:time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert bounds("vllm:time_to_first_token_seconds")[-2:] == [2560.0, float("inf")]
    assert bounds("vllm:inter_token_latency_seconds")[-2:] == [80.0, float("inf")]
    assert bounds("vllm:e2e_request_latency_seconds")[:2] == [0.3, 0.5]
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "128" and info["num_gpu_blocks"] == "32768" and "model_name" not in info
    assert "prefix_caching_hash_algo" in info and info["enable_prefix_caching"] == "True"


def test_responses_api_plain_and_streaming(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=10,
                                   extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.output_text
    assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 0
    events = list(client.responses.create(model=MODEL, input="Hello there", max_output_tokens=10, stream=True,
                                          extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}}))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_anthropic_messages_plain_and_streaming(sim: SimProcess) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "disabled"}}
    plain = httpx.post(f"{sim.url}/v1/messages", json=body).json()
    assert plain["type"] == "message" and plain["content"][0]["type"] == "text"
    assert plain["usage"]["input_tokens"] > 0 and plain["stop_reason"] in ("end_turn", "max_tokens")
    with httpx.stream("POST", f"{sim.url}/v1/messages", json={**body, "stream": True}) as r:
        text = r.read().decode()
    events = [block.split("\n")[0].removeprefix("event: ") for block in text.strip().split("\n\n")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in events and "[DONE]" not in text


def test_tokenizer_dir_gives_exact_counts_of_the_rendered_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["simulated replicas answer quickly"] * 40,
                            trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    with running_sims([{"max_model_len": 1024, "extra_args": ["--tokenizer", str(tmp_path)]}]) as (s,):
        messages = [{"role": "user", "content": "simulated replicas"}]
        counted = httpx.post(f"{s.url}/tokenize", json={"messages": messages}).json()
        chat = httpx.post(f"{s.url}/v1/chat/completions",
                          json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    expected = tok.encode("<s>[user] simulated replicas\n[assistant] ", add_special_tokens=False).ids
    assert counted["tokens"] == expected and counted["count"] == len(expected)
    assert chat["usage"]["prompt_tokens"] == len(expected)


def test_n_samples_logprobs_and_created_cache_tokens(sim: SimProcess, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "n samples " * 100}]
    prompt_tokens = count_tokens(sim, messages, chat_template_kwargs={"thinking_mode": "disabled"})
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "n": 3, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2, "chat_template_kwargs": {"thinking_mode": "disabled"}}
    result = httpx.post(f"{sim.url}/v1/chat/completions", json=body).json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    texts = {c["message"]["content"] for c in result["choices"]}
    assert len(texts) > 1, "each sample has its own plan"
    for choice in result["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4 and all(len(e["top_logprobs"]) == 2 for e in content)
        assert "".join(e["token"] for e in content) == choice["message"]["content"]
    usage = result["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == prompt_tokens
    assert usage["prompt_tokens_details"]["created_cache_tokens"] == prompt_tokens // 128 * 128

    stream = client.completions.create(model=MODEL, prompt="two samples", max_tokens=3, n=2, stream=True, logprobs=1,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert all(len(c.choices[0].logprobs.top_logprobs[0]) == 2 for c in chunks if c.choices)  # type: ignore[union-attr]


def test_sampling_parameters_are_validated_like_sampling_params(sim: SimProcess) -> None:
    def error(body: dict[str, object]) -> dict[str, object]:
        r = httpx.post(f"{sim.url}/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
        assert r.status_code == 400
        return r.json()["error"]

    assert error({"temperature": -1}) == {
        "message": "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
        "type": "BadRequestError", "param": "temperature", "code": 400}
    assert error({"n": 2, "temperature": 0})["message"] == "n must be 1 when using greedy sampling, got 2."
    assert error({"max_tokens": 0})["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert error({"messages": []})["message"] == (
        "Cannot apply chat template to an empty conversation. Provide at least one message.")


def test_detokenize_returns_the_text_of_tokenized_ids(sim: SimProcess) -> None:
    text = "Détokenize me, please: ids → text."
    ids = httpx.post(f"{sim.url}/tokenize", json={"prompt": text}).json()["tokens"]
    assert httpx.post(f"{sim.url}/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    missing = httpx.post(f"{sim.url}/detokenize", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.tokens"


def test_media_are_counted_in_the_mm_cache_and_usage() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with running_sims([{"max_model_len": 4096, "extra_args": ["--modalities", "text,image", "--instant"]}]) as (s,):
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]}
        first = httpx.post(f"{s.url}/v1/chat/completions", json=body).json()
        httpx.post(f"{s.url}/v1/chat/completions", json=body)
        metrics = httpx.get(f"{s.url}/metrics").text
    assert first["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": 256}

    def value(name: str) -> float:
        return float(next(ln for ln in metrics.splitlines() if ln.startswith(name + "{")).rsplit(" ", 1)[1])

    assert (value("vllm:mm_cache_queries_total"), value("vllm:mm_cache_hits_total")) == (2.0, 1.0)
