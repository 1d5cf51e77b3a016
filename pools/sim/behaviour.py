"""What the simulated MiniMax-M3 "says": deterministic output plans and the text of each generated token.

An `OutputPlan` fixes, before generation starts, how many tokens go to reasoning, content or a tool call, and why
generation ends. It depends only on the replica's seed, the prompt's content and the request's parameters, so a test
can rely on the same request getting the same shape of answer.

MiniMax-M3 facts imitated (contract §8): `chat_template_kwargs.thinking_mode` "enabled" starts inside reasoning,
"disabled" never reasons, "adaptive"/unset reasons on some prompts; tool calls are written in the native
`]<]minimax[>[<tool_call>…` syntax (their tokens count as output), streamed as a name delta then the arguments once
per invoke; finish_reason becomes "tool_calls" unless tool_choice named a function.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

from pools.sim.protocol import request_validation_error
from pools.sim.structured import Constraint, write
from pools.sim.tokenizer import TEXT_VOCAB_SIZE

# Output vocabulary (the top of the tokenizer's, which prompt text never maps into): an answer's first token id
# carries the request's plan flags (what a completions request continuing the answer cannot see: chat or not,
# thinking mode, tool_choice), every later token id its index. So a context that ends in generated tokens tells
# where its prompt ends, and a greedy answer is a function of the context alone (see `find_answer`).
FIRST_TOKEN_BASE = TEXT_VOCAB_SIZE
ANSWER_TOKEN_BASE = TEXT_VOCAB_SIZE + 4096
ANSWER_BAND = 65536
THINK_START = "<mm:think>"
THINK_END = "</mm:think>"
_THINKING_CODES = {"enabled": 1, "disabled": 2}
_CHOICE_CODES = {"required": 1, "none": 3}

TOOL_TAG = "]<]minimax[>["

CONTENT_WORDS = ("The", " replica", " answers", " with", " simulated", " tokens", " that", " carry", " no", " meaning",
                 ",", " but", " their", " count", " timing", " and", " shape", " follow", " the", " real", " server",
                 ".", " Each", " word", " stands", " for", " one", " token", " of", " output", " here", " so")
REASONING_WORDS = ("Let", " me", " think", " about", " this", " request", " step", " by", " step", ":", " first",
                   " consider", " the", " question", ",", " then", " check", " each", " case", " and", " decide",
                   ".", " Hmm", " maybe", " there", " is", " a", " simpler", " way", " to", " see", " it")


@dataclass(frozen=True)
class ToolCallPlan:
    call_id: str
    name: str
    arguments: str  # JSON text, as it appears in tool_calls[].function.arguments
    tokens: int  # output tokens the native tool-call markup takes
    markup: str = ""  # the native markup itself: the raw text of those tokens (completions show it)

    @property
    def header_at(self) -> int:
        """Tool-token index at which the parser has seen `<invoke name="…">` and streams the name."""
        return min(3, self.tokens - 1)


@dataclass(frozen=True)
class OutputPlan:
    reasoning_tokens: int
    content_tokens: int
    tool_call: ToolCallPlan | None
    finish_reason: str  # when every planned token is out: "stop" | "length" | "tool_calls"
    word_offset: int  # where in the word lists this answer starts (varies the text between prompts)
    flags: int = 0  # plan flags carried by the first token id (`plan_flags`)
    opens_thinking: bool = False  # the raw text opens reasoning with <mm:think> (the template did not)
    content_text: str | None = None  # structured output: the whole constrained text (content may stop short of it)

    @property
    def content_text_tokens(self) -> int:
        return text_tokens(self.content_text or "")

    @property
    def total_tokens(self) -> int:
        return self.reasoning_tokens + self.content_tokens + (self.tool_call.tokens if self.tool_call else 0)

    @property
    def engine_finish(self) -> str:
        """The engine's finish reason (vLLM's: the tool-call rewrite happens in the API layer)."""
        return "length" if self.finish_reason == "length" else "stop"

    def piece(self, index: int) -> tuple[str, str]:
        """(kind, text) of output token `index`: kind is "reasoning", "content" or "tool"."""
        if index < self.reasoning_tokens:
            return "reasoning", REASONING_WORDS[(self.word_offset + index) % len(REASONING_WORDS)]
        index -= self.reasoning_tokens
        if index < self.content_tokens:
            if self.content_text is not None:
                size = -(-len(self.content_text) // self.content_text_tokens)
                return "content", self.content_text[index * size:(index + 1) * size]
            return "content", CONTENT_WORDS[(self.word_offset + index) % len(CONTENT_WORDS)]
        return "tool", ""

    def token_id(self, index: int) -> int:
        """The id of output token `index` (see FIRST_TOKEN_BASE)."""
        return FIRST_TOKEN_BASE + self.flags if index == 0 else ANSWER_TOKEN_BASE + index % ANSWER_BAND

    def raw_piece(self, index: int) -> str:
        """What the model itself writes for token `index`, before any reasoning or tool parser: reasoning inside
        <mm:think>…</mm:think>, the tool call as native markup. Completions show this text."""
        kind, text = self.piece(index)
        if kind == "reasoning":
            if index == 0 and self.opens_thinking:
                text = THINK_START + text
            if index == self.reasoning_tokens - 1 and index < self.total_tokens - 1:
                text += THINK_END
            return text
        if kind == "tool" and self.tool_call is not None:
            call = self.tool_call
            j = index - self.reasoning_tokens - self.content_tokens
            size = -(-len(call.markup) // call.tokens)
            return call.markup[j * size:(j + 1) * size]
        return text

    def text(self, kind: str, upto: int | None = None) -> str:
        """All reasoning or content text of the first `upto` tokens (all when None)."""
        end = self.total_tokens if upto is None else upto
        return "".join(t for k, t in (self.piece(i) for i in range(end)) if k == kind)


def _value_for(schema: dict[str, Any], rng: random.Random) -> Any:
    if not isinstance(schema, dict):
        return "value"
    if schema.get("enum"):
        return rng.choice(list(schema["enum"]))
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "integer":
        return rng.randint(1, 100)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value_for(schema.get("items", {}), rng)]
    if kind == "object":
        return _arguments_for(schema, rng)
    return rng.choice(("Paris", "example", "simulated value", "42 Main Street", "MiniMax"))


def _arguments_for(schema: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    props = schema.get("properties") or {}
    required = schema.get("required") or sorted(props)  # sorted: the order survives rendering (sort_keys)
    return {name: _value_for(props.get(name, {}), rng) for name in required}


def native_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The M3 native markup the model would emit (its length sets the tool call's token count)."""
    args = "".join(f"{TOOL_TAG}<{k}>{v if isinstance(v, str) else json.dumps(v)}{TOOL_TAG}</{k}>"
                   for k, v in arguments.items())
    return (f'{TOOL_TAG}<tool_call>{TOOL_TAG}<invoke name="{name}">{args}{TOOL_TAG}</invoke>'
            f"{TOOL_TAG}</tool_call>")


def _tool_name(tool: dict[str, Any]) -> str:
    fn = tool.get("function", tool)
    return str(fn.get("name", "tool"))


def _tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    schema = fn.get("parameters") or fn.get("input_schema") or {}
    return schema if isinstance(schema, dict) else {}


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Refuse tools whose `function` is there but not an object, word for word as vLLM 0.32 does over HTTP (its
    ChatCompletionToolsParam.function is a pydantic model): 400 "Bad Request" listing every such tool. Without this,
    `_tool_name` / `_tool_schema` crashed on it (a plain 500) whenever the plan called a tool. The chat route calls
    it right after validating the body (vLLM validates the tools whatever `tool_choice` says, before it looks up the
    model); `plan_output` calls it again for its other callers."""
    errors = [{"type": "model_attributes_type", "loc": ("body", "tools", i, "function"),
               "msg": "Input should be a valid dictionary or object to extract fields from", "input": tool["function"]}
              for i, tool in enumerate(tools or ()) if "function" in tool and not isinstance(tool["function"], dict)]
    if errors:
        raise request_validation_error(errors)


def named_tool(tool_choice: Any) -> str | None:
    """The function name when tool_choice forces one ({"type":"function","function":{"name":…}} or {"name":…})."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if isinstance(fn, dict) and fn.get("name"):
            return str(fn["name"])
        if tool_choice.get("name"):
            return str(tool_choice["name"])
    return None


def plan_flags(*, chat: bool, thinking_mode: str | None, tools: list[dict[str, Any]] | None,
               tool_choice: Any) -> int:
    """What the answer's first token id records of the request: chat (bit 0), thinking mode (bits 1-2), tools
    offered (bit 3), tool_choice auto/required/named/none (bits 4-5) and the named tool's index (bits 6-11)."""
    flags = int(chat) | _THINKING_CODES.get(thinking_mode or "", 0) << 1 | int(bool(tools)) << 3
    forced = named_tool(tool_choice)
    if forced is not None:
        index = next((i for i, t in enumerate(tools or ()) if _tool_name(t) == forced), 0)
        flags |= 2 << 4 | (index & 63) << 6
    elif isinstance(tool_choice, str):
        flags |= _CHOICE_CODES.get(tool_choice, 0) << 4
    return flags


def plan_inputs(flags: int, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """`plan_output` arguments recorded in `flags`; `tools` are the ones the prompt offers (read from it)."""
    thinking = {v: k for k, v in _THINKING_CODES.items()}.get(flags >> 1 & 3)
    offered = tools if flags >> 3 & 1 else None
    code = flags >> 4 & 3
    choice: Any = {0: None, 1: "required", 3: "none"}.get(code)
    if code == 2 and offered:
        index = min(flags >> 6 & 63, len(offered) - 1)
        choice = {"type": "function", "function": {"name": _tool_name(offered[index])}}
    return {"chat": bool(flags & 1), "thinking_mode": thinking, "tools": offered if choice != "none" else None,
            "tool_choice": choice}


def find_answer(ids: list[int]) -> tuple[int, int] | None:
    """Where a context's trailing generated tokens begin, and the plan flags of their first token; None when the
    context does not end in an answer (then it is all prompt)."""
    i = len(ids) - 1
    while i >= 0 and ANSWER_TOKEN_BASE <= ids[i] < ANSWER_TOKEN_BASE + ANSWER_BAND:
        i -= 1
    if i < 1 or not FIRST_TOKEN_BASE <= ids[i] < ANSWER_TOKEN_BASE:
        return None
    if any(ids[i + m] != ANSWER_TOKEN_BASE + m % ANSWER_BAND for m in range(1, len(ids) - i)):
        return None
    return i, ids[i] - FIRST_TOKEN_BASE


def tools_in_prompt(text: str) -> list[dict[str, Any]] | None:
    """The tools a prompt rendered by the built-in template offers (`# Tools` section), as request tools."""
    start = text.find("\n<tools>\n")
    end = text.find("\n</tools>", start + 1)
    if start < 0 or end < 0:
        return None
    tools = []
    for line in text[start + 9:end].split("\n"):
        try:
            fn = json.loads(line)
        except ValueError:
            return None
        tools.append({"type": "function", "function": fn})
    return tools or None


def text_tokens(text: str) -> int:
    """The tokens a constrained text takes (4 bytes each, as the built-in tokenizer counts; at least one)."""
    return max(1, -(-len(text.encode()) // 4))


def _structured_plan(constraint: Constraint, rng: random.Random, max_tokens: int, thinking: bool, offset: int,
                     flags: int, opens: bool) -> OutputPlan:
    """An answer under structured output: reasoning (unconstrained, as vLLM applies the grammar once reasoning
    ends), then the constrained text, cut at max_tokens ("length", the value left unfinished) as vLLM cuts it.
    No tool call: the grammar admits no tool-call markup."""
    text = write(constraint, rng)
    reasoning = min(rng.randint(8, 64), max_tokens) if thinking else 0
    needed, budget = text_tokens(text), max_tokens - reasoning
    finish = "stop" if needed < budget else "length"
    return OutputPlan(reasoning, min(needed, budget), None, finish, offset, flags, opens, text)


def plan_output(*, seed: int, fingerprint: int, max_tokens: int, chat: bool, thinking_mode: str | None = None,
                tools: list[dict[str, Any]] | None = None, tool_choice: Any = None, ignore_eos: bool = False,
                min_tokens: int = 0, mean_output_tokens: int = 256, tool_call_probability: float = 0.5,
                adaptive_thinking_probability: float = 0.5, structured: Constraint | None = None) -> OutputPlan:
    """Decide the answer's shape. `fingerprint` identifies the prompt (equal prompts → equal plans)."""
    check_tools(tools)  # before any random draw: a bad tool is refused whatever the plan would have been
    rng = random.Random((seed << 64) ^ fingerprint)
    max_tokens = max(1, max_tokens)
    if ignore_eos or mean_output_tokens <= 0:
        natural = max_tokens
    else:
        natural = max(1, min_tokens, round(mean_output_tokens * rng.uniform(0.5, 1.5)))
    length = min(natural, max_tokens)
    finish = "stop" if natural < max_tokens else "length"
    offset = rng.randrange(1 << 16)

    thinking = chat and (thinking_mode == "enabled" or (
        thinking_mode != "disabled" and rng.random() < adaptive_thinking_probability))

    flags = plan_flags(chat=chat, thinking_mode=thinking_mode, tools=tools, tool_choice=tool_choice)
    opens = thinking and thinking_mode != "enabled"
    if structured is not None and structured.constrains_text:
        return _structured_plan(structured, rng, max_tokens, thinking, offset, flags, opens)
    forced = named_tool(tool_choice)
    wants_tool = bool(tools) and tool_choice != "none" and (
        tool_choice == "required" or forced is not None or rng.random() < tool_call_probability)
    if chat and wants_tool and tools:
        tool = next((t for t in tools if _tool_name(t) == forced), None) if forced else rng.choice(tools)
        if tool is not None:
            arguments = _arguments_for(_tool_schema(tool), rng)
            markup = native_tool_call(_tool_name(tool), arguments)
            tokens = max(2, -(-len(markup.encode()) // 4))
            reasoning = min(rng.randint(8, 64), max_tokens - tokens) if thinking else 0
            if reasoning >= 0 and tokens + reasoning <= max_tokens:
                call = ToolCallPlan(f"chatcmpl-tool-{uuid.uuid4().hex}", _tool_name(tool),
                                    json.dumps(arguments, ensure_ascii=False), tokens, markup)
                return OutputPlan(reasoning, 0, call, "stop" if forced else "tool_calls", offset, flags,
                                  opens)

    if thinking:
        reasoning = length if length < 2 else min(length - 1, max(1, round(length * rng.uniform(0.2, 0.6))))
    else:
        reasoning = 0
    return OutputPlan(reasoning, length - reasoning, None, finish, offset, flags, opens)
