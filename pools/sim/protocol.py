"""vLLM 0.32's request models and error shapes, reduced to what a gateway can observe.

Errors are always `{"error":{"message","type","param","code"}}` with the HTTP status equal to `code` (contract §4).
Request bodies are parsed with pydantic like vLLM's FastAPI layer, and validation failures are reported the way
FastAPI's RequestValidationError prints (`"N validation error(s):\\n  {…}"`, type "Bad Request").
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.responses import Response

JSON = "application/json"


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.err_type, "param": self.param,
                                       "code": self.status}})

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type=JSON)


def bad_request(message: str, param: str | None = None) -> ApiError:
    """VLLMValidationError / ValueError → 400 BadRequestError."""
    return ApiError(400, message, "BadRequestError", param)


def vllm_validation_error(message: str, parameter: str, value: Any) -> ApiError:
    """VLLMValidationError: its __str__ appends `(parameter=…, value=…)` and `param` names the parameter."""
    return bad_request(f"{message} (parameter={parameter}, value={value})", parameter)


def request_validation_error(errors: list[Any]) -> ApiError:
    """FastAPI's RequestValidationError as vLLM reports it: type "Bad Request", param the first error's location."""
    n = len(errors)
    message = f"{n} validation error{'s' if n != 1 else ''}:\n" + "\n".join(f"  {e}" for e in errors)
    param = None
    first = errors[0] if errors else None
    if isinstance(first, dict) and first.get("loc"):
        param = ".".join(str(p) for p in first["loc"])
    return ApiError(400, message, "Bad Request", param)


def not_found_model(name: str, valid: tuple[str, ...]) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist. Valid aliases: {', '.join(valid)}.", "NotFoundError",
                    "model")


def unsupported_media_type() -> ApiError:
    return request_validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise request_validation_error([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                         "input": {}, "ctx": {"error": exc.msg}}]) from None


def validate(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors(include_url=False):
            err = dict(err)
            err["loc"] = ("body", *err["loc"])
            errors.append(err)
        raise request_validation_error(errors) from None


class _Request(BaseModel):
    """Unknown fields are accepted, as vLLM's `extra="allow"` models do."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _generation_prompt_xor_continue(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    use_beam_search: bool = False


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _generation_prompt_xor_continue(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool | None = False
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    request_id: str | None = None


class MessagesRequest(BaseModel):
    """Anthropic Messages API (vLLM's /v1/messages)."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
