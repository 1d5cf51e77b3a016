"""Structured-output integrations tested as users run them: the OpenAI SDK's `parse` with a pydantic model (what
LangChain's `with_structured_output(method="json_schema")` sends: a strict `json_schema` response_format with
`$defs`) and `json_object`, plain and streamed, through the gateway to a simulated pool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import Enum

import openai
import pytest
from pydantic import BaseModel, Field

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"


class Colour(str, Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(min_length=2, max_length=20)
    age: int = Field(ge=0, le=120)
    favourite: Colour
    addresses: list[Address] = Field(max_length=3)
    nickname: str | None


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_sims([{"max_model_len": 32768, "extra_args": ["--instant"]}]) as (sim,):
        gw = start_gateway({"model": MODEL, "pools": [{"name": "p", "max_model_len": 32768, "endpoints": [sim.url]}],
                            "server": {"health_interval_s": 0.5}})
        try:
            yield gw
        finally:
            gw.stop()


def test_the_sdks_parse_gets_a_valid_model(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0, timeout=60)
    for i in range(5):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": f"Describe person {i}."}], response_format=Person,
            max_tokens=2000, extra_body={"chat_template_kwargs": {"thinking_mode": "adaptive"}})
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person), message.content


def test_a_streamed_json_object_and_a_truncated_one(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], stream=True,
        response_format={"type": "json_object"}, max_tokens=500)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and isinstance(json.loads("".join(pieces)), dict)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                      response_format=Person, max_tokens=4,
                                      extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
