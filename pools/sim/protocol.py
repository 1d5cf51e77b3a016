"""vLLM 0.32's request models and error shapes, reduced to what a gateway can observe.

Errors are always `{"error":{"message","type","param","code"}}` with the HTTP status equal to `code` (contract §4).
Request bodies are parsed with pydantic like vLLM's FastAPI layer, and validation failures are reported the way
vLLM's RequestValidationError handler prints them (`"N validation error(s):\\n  {…}"`, type "Bad Request", `loc`
dotted, `input` summarised). vLLM's `mode="before"` model validators raise VLLMValidationError, which escapes
pydantic and becomes a plain BadRequestError: `precheck_*` run those checks on the raw body, in vLLM's order (the
last-defined validator runs first), before the pydantic models see it. `check_sampling` is SamplingParams'
`_verify_args`, run where vLLM builds the sampling parameters (after the prompt length checks).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

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


def vllm_validation_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """VLLMValidationError: its __str__ appends `(parameter=…, value=…)` (each only when not None) and `param`
    names the parameter."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return bad_request(f"{message} ({', '.join(extras)})" if extras else message, parameter)


_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _summarize_input(value: Any) -> Any:
    """vLLM's `_summarize_error_input`: containers are described, long strings cut, other values stringified."""
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """`('body', 'function-after[...]', 'messages')` → `body.messages` (pydantic's wrapper markers dropped)."""
    parts = [str(p) for p in loc if not _internal_loc_segment(str(p))]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


_INTERNAL_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype"})


def _internal_loc_segment(segment: str) -> bool:
    return any(c in segment for c in "[]{}()") or segment.lower() in _INTERNAL_LOC_MARKERS


def _format_error(err: Any) -> str:
    if isinstance(err, dict):
        err = dict(err)
        if "input" in err:
            err["input"] = _summarize_input(err["input"])
        if isinstance(err.get("loc"), (tuple, list)):
            err["loc"] = _clean_loc(tuple(err["loc"]))
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def request_validation_error(errors: list[Any]) -> ApiError:
    """FastAPI's RequestValidationError as vLLM's handler reports it: type "Bad Request", at most ten errors, each
    with a dotted `loc` and a summarised `input`; param the first error's dotted location."""
    n = len(errors)
    label = "error" if n == 1 else "errors"
    reported = errors[:_MAX_REPORTED_ERRORS]
    message = f"{n} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in reported)
    if n > len(reported):
        message += f"  ...and {n - len(reported)} more {label}\n"
    param = None
    first = errors[0] if errors else None
    if isinstance(first, dict) and first.get("loc"):
        param = _clean_loc(tuple(first["loc"]))
    return ApiError(400, message.rstrip(), "Bad Request", param)


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


class _VllmModel(BaseModel):
    """vLLM's OpenAIBaseModel: extra fields allowed, and a wrap validator whose marker (`function-wrap[…]`) is what
    a union member's errors carry in their `loc` (dropped when printed) instead of the class name."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def __log_extra_fields__(cls, data: Any, handler: Any) -> Any:
        return handler(data)


class JsonSchemaResponseFormat(_VllmModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_VllmModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuralTagResponseFormat(_VllmModel):
    type: Literal["structural_tag"]
    format: Any


class LegacyStructuralTag(_VllmModel):
    begin: str
    structural_tag_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class LegacyStructuralTagResponseFormat(_VllmModel):
    type: Literal["structural_tag"]
    structures: list[LegacyStructuralTag]
    triggers: list[str]


AnyResponseFormat = ResponseFormat | StructuralTagResponseFormat | LegacyStructuralTagResponseFormat


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
    kv_transfer_params: dict[str, Any] | None = None  # acted on only with a KV connector (--role prefill/decode)
    use_beam_search: bool = False
    return_token_ids: bool | None = None  # prompt ids in the first chunk, each chunk's own ids after
    # sampling parameters (validated like SamplingParams; the simulator's text does not depend on them)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None  # VLLM_MAX_STOP_STRINGS
    response_format: AnyResponseFormat | None = None  # pools/sim/structured.py acts on these two
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n


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
    logprobs: bool | None = False
    top_logprobs: int | None = 0

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: `top_logprobs` when `logprobs` is on, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


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


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


# ---------------------------------------------------------------------------------------------------------------
# vLLM's `mode="before"` model validators (they raise VLLMValidationError, which pydantic does not wrap)

MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES
MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
MAX_LOGPROBS = 20  # ModelConfig.max_logprobs
_SAMPLING_EPS = 1e-5
_CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\0")


def _check_generation_prompt(data: dict[str, Any]) -> None:
    # Only explicit values count here; the defaults meet later, in the chat template (see tokenizer.py).
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise vllm_validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def _check_stream_options(data: dict[str, Any]) -> None:
    if data.get("stream_options") and not data.get("stream"):
        raise vllm_validation_error("Stream options can only be defined when `stream=True`.", "stream_options")


def _check_cache_salt(data: dict[str, Any]) -> None:
    salt = data.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise vllm_validation_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > 128 or any(c in salt for c in _CACHE_SALT_FORBIDDEN):
        raise vllm_validation_error("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
                                    "'/', '\\\\', or NUL.", "cache_salt")


def _check_integer_fields(data: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = data.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise vllm_validation_error(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = data.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise vllm_validation_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise vllm_validation_error("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs",
                                        prompt_logprobs)


def _check_tool_usage(data: dict[str, Any]) -> None:
    if data.get("tools") == []:
        raise vllm_validation_error("`tools` must not be an empty array. Either provide at least one tool or omit "
                                    "the field entirely.", "tools")
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if data.get("tools") is None:
        raise vllm_validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise vllm_validation_error(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                                    f"or \"required\" are supported.", "tool_choice")
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise vllm_validation_error(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                                        "tool_choice.function")
        if "name" not in function:
            raise vllm_validation_error(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                                        "tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise vllm_validation_error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                                        "tool_choice.function.name")
        if not _names_a_tool(data["tools"], name):
            raise vllm_validation_error("The tool specified in `tool_choice` does not match any of the specified "
                                        "`tools`", "tool_choice")


def _check_structured_outputs_count(data: dict[str, Any], *, chat: bool) -> None:
    """At most one of json, regex and choice; in chat, not with a named tool_choice."""
    params = data.get("structured_outputs")
    if not isinstance(params, dict):
        return
    count = sum(params.get(k) is not None for k in ("json", "regex", "choice"))
    message = "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."
    if count > 1:
        raise bad_request(message) if chat else vllm_validation_error(message, "structured_outputs")
    if chat and count > 0 and data.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise bad_request("You can only either use constraints for structured outputs or tools, not both.")


def _check_response_format(data: dict[str, Any]) -> None:
    """A json_schema response_format needs its `json_schema` object."""
    response_format = data.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema" \
            and response_format.get("json_schema") is None:
        raise vllm_validation_error("When response_format type is 'json_schema', the 'json_schema' field must be "
                                    "provided.", "response_format")


def _names_a_tool(tools: Any, name: str) -> bool:
    """vLLM's own loop (`tool["function"]["name"] == name` over the tools until one matches), run before pydantic
    has checked the tools: a malformed tool before the match fails as it fails there. Its handler answers the raw
    TypeError (a tool or `function` that is a string, list, number or null; `tools` not a list) with a 400
    BadRequestError carrying the exception's text, and anything else (KeyError: no `function` or `name`) with a 500."""
    try:
        for tool in tools:
            if tool["function"]["name"] == name:
                return True
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad_request(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - vLLM's catch-all handler
        raise ApiError(500, str(exc), "InternalServerError") from None
    return False


def precheck_chat(data: Any) -> None:
    """ChatCompletionRequest's before-validators, in the order vLLM runs them."""
    if not isinstance(data, dict):
        return
    _check_generation_prompt(data)
    _check_tool_usage(data)
    _check_structured_outputs_count(data, chat=True)
    _check_integer_fields(data, ("prompt_logprobs", "top_logprobs"))
    top = data.get("top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise vllm_validation_error("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise vllm_validation_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    _check_stream_options(data)
    _check_response_format(data)
    _check_cache_salt(data)


def precheck_completion(data: Any) -> Any:
    """CompletionRequest's before-validators, in vLLM's order; returns the body with `max_tokens: null` → 16."""
    if not isinstance(data, dict):
        return data
    prompt = data.get("prompt")
    if (isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt)
            and len(prompt) > MAX_COMPLETION_PROMPTS):
        raise vllm_validation_error(f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                                    f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                                    f"VLLM_MAX_COMPLETION_PROMPTS environment variable.", "prompt")
    embeds = data.get("prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        raise vllm_validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    _check_stream_options(data)
    _check_integer_fields(data, ("prompt_logprobs", "logprobs"))
    logprobs = data.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise vllm_validation_error("`logprobs` must be a positive value or -1.", "logprobs", logprobs)
    _check_structured_outputs_count(data, chat=False)
    _check_response_format(data)
    if "max_tokens" in data and data["max_tokens"] is None:
        data = {**data, "max_tokens": 16}
    _check_cache_salt(data)
    return data


def precheck_tokenize_chat(data: Any) -> None:
    if isinstance(data, dict):
        _check_generation_prompt(data)


def check_sampling(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, *, vocab_size: int) -> None:
    """SamplingParams' checks (`_verify_args`, greedy sampling, then the engine's logprobs cap), vLLM's order and
    words; `temperature`/`top_p`/… default to vLLM's neutral values when the request leaves them out."""
    n = req.num_choices
    if n < 1:
        raise vllm_validation_error(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise vllm_validation_error(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
                                    f"VLLM_MAX_N_SEQUENCES environment variable.")
    presence = 0.0 if req.presence_penalty is None else req.presence_penalty
    frequency = 0.0 if req.frequency_penalty is None else req.frequency_penalty
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k is None else req.top_k
    min_p = 0.0 if req.min_p is None else req.min_p
    if not -2.0 <= presence <= 2.0:
        raise vllm_validation_error(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= frequency <= 2.0:
        raise vllm_validation_error(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if not math.isfinite(repetition):
        raise vllm_validation_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise vllm_validation_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    if not math.isfinite(temperature):
        raise vllm_validation_error(f"temperature must be a finite number, got {temperature}.", "temperature",
                                    temperature)
    if temperature < 0.0:
        raise vllm_validation_error(f"temperature must be non-negative, got {temperature}.", "temperature",
                                    temperature)
    if temperature > 2.0:
        raise vllm_validation_error(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if not 0.0 < top_p <= 1.0:
        raise vllm_validation_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if top_k < -1:
        raise vllm_validation_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise vllm_validation_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise vllm_validation_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if req.min_tokens < 0:
        raise vllm_validation_error(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.")
    if req.min_tokens > max_tokens:
        raise vllm_validation_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                                    f"{req.min_tokens}.")
    logprobs = req.num_logprobs
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise vllm_validation_error(f"logprobs must be non-negative or -1, got {logprobs}.", "logprobs", logprobs)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise vllm_validation_error("stop cannot contain an empty string.")
    if temperature < _SAMPLING_EPS and n > 1:
        raise vllm_validation_error(f"n must be 1 when using greedy sampling, got {n}.")
    if logprobs:
        wanted = vocab_size if logprobs == -1 else logprobs
        if wanted > MAX_LOGPROBS:
            raise vllm_validation_error(f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                                        f"{MAX_LOGPROBS}", "logprobs", wanted)


class ResponseFormatText(BaseModel):
    """The Responses API's `text.format` members: the openai package's models (no wrap validator, so a union
    member's errors carry its class name in `loc`, as vLLM prints them)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]


class ResponseFormatTextJSONSchemaConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    schema_: dict[str, object] = Field(alias="schema")
    type: Literal["json_schema"]
    description: str | None = None
    strict: bool | None = None


class ResponseFormatJSONObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["json_object"]


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: ResponseFormatText | ResponseFormatTextJSONSchemaConfig | ResponseFormatJSONObject | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


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
    text: ResponseTextConfig | None = None
    structured_outputs: dict[str, Any] | None = None


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
