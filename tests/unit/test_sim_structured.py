"""pools/sim/structured.py and its answer plans: every value the simulator writes under a schema validates against
it (the schemas clients send: pydantic's `$defs`/`anyOf`/`allOf`, formats, bounds, nesting), the same request gets
the same value, a small budget cuts it, and a schema vLLM 0.32 refuses is refused with llguidance's words."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from pools.sim.behaviour import plan_output
from pools.sim.protocol import ApiError
from pools.sim.structured import Constraint, schema_problem, validate, write

PYDANTIC_NESTED = {  # what pydantic's model_json_schema() gives for a model with a nested, optional and list field
    "$defs": {
        "Address": {"properties": {"city": {"title": "City", "type": "string"},
                                   "zip": {"pattern": "^[0-9]{5}$", "title": "Zip", "type": "string"}},
                    "required": ["city"], "title": "Address", "type": "object"},
        "Role": {"enum": ["admin", "editor"], "title": "Role", "type": "string"},
    },
    "properties": {
        "name": {"title": "Name", "type": "string", "minLength": 2, "maxLength": 12},
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Nickname"},
        "role": {"$ref": "#/$defs/Role"},
        "home": {"$ref": "#/$defs/Address"},
        "previous": {"items": {"$ref": "#/$defs/Address"}, "title": "Previous", "type": "array", "maxItems": 2},
        "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "level": {"type": "integer", "minimum": -20, "maximum": -10},
    },
    "required": ["name", "role", "home", "previous", "score", "level"],
    "title": "Person", "type": "object",
}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object"},
    {},
    {"type": "string", "enum": ["red", "green"]},
    {"const": {"fixed": [1, 2]}},
    {"type": ["integer", "null"], "minimum": 5, "maximum": 5},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 4, "maxItems": 6},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    {"type": "object", "properties": {"never": {"type": "integer", "minimum": 3, "maximum": 1}, "n": {"type": "null"}}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                      "id": {"type": "string", "format": "uuid"},
                                      "mail": {"type": "string", "format": "email"},
                                      "day": {"type": "string", "format": "date"}},
     "required": ["when", "id", "mail", "day"], "additionalProperties": False},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"type": "string", "minLength": 30}}, "required": ["b"]}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"]},
               {"type": "object", "properties": {"kind": {"const": "square"}}, "required": ["kind"]}]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}}, "required": ["v"]},
    {"type": "number", "maximum": -3.5},
    {"type": "array", "items": {"type": "string", "minLength": 5, "maxLength": 2}},
    {"anyOf": [{"type": "integer", "minimum": 3, "maximum": 1}, {"type": "string"}]},
    PYDANTIC_NESTED,
]


def _plan(constraint: Constraint | None, *, max_tokens: int = 2000, fingerprint: int = 1, thinking: str = "disabled",
          seed: int = 0, **extra: Any) -> Any:
    return plan_output(seed=seed, fingerprint=fingerprint, max_tokens=max_tokens, chat=True, thinking_mode=thinking,
                       structured=constraint, **extra)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_every_value_written_validates_against_its_schema(schema: dict[str, Any]) -> None:
    assert schema_problem(schema, schema) is None  # vLLM accepts each of these
    for fingerprint in range(25):
        plan = _plan(Constraint("json", schema), fingerprint=fingerprint)
        assert plan.finish_reason == "stop"
        text = plan.text("content")
        assert text == plan.content_text
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_and_choice() -> None:
    for fingerprint in range(10):
        assert isinstance(json.loads(_plan(Constraint("json_object", True), fingerprint=fingerprint).text("content")),
                          dict)
        assert _plan(Constraint("choice", ["yes", "no"]), fingerprint=fingerprint).text("content") in ("yes", "no")
    prose = _plan(Constraint("regex", "[a-z]+"))
    assert prose.content_text is None  # regex / grammar / structural_tag: accepted, answered in prose


def test_the_value_is_a_function_of_the_seed_and_the_prompt() -> None:
    constraint = Constraint("json", PYDANTIC_NESTED)
    assert _plan(constraint, fingerprint=7).content_text == _plan(constraint, fingerprint=7).content_text
    values = {_plan(constraint, fingerprint=f).content_text for f in range(10)}
    assert len(values) > 5  # other prompts, other values
    assert _plan(constraint, fingerprint=7, seed=1).content_text != _plan(constraint, fingerprint=7).content_text


def test_a_small_budget_cuts_the_value_with_length() -> None:
    constraint = Constraint("json", PYDANTIC_NESTED)
    whole = _plan(constraint)
    for budget in (1, 3, whole.content_text_tokens - 1, whole.content_text_tokens):
        cut = _plan(constraint, max_tokens=budget)
        assert cut.finish_reason == "length" and cut.total_tokens == budget
        text = cut.text("content")
        assert whole.content_text.startswith(text) and len(text) < len(whole.content_text) or \
            budget == whole.content_text_tokens
    assert _plan(constraint, max_tokens=whole.content_text_tokens + 1).finish_reason == "stop"


def test_reasoning_comes_first_and_no_tool_is_called() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    plan = _plan(Constraint("json_object", True), thinking="enabled", tools=tools, tool_choice="required")
    assert plan.reasoning_tokens > 0 and plan.tool_call is None and plan.finish_reason == "stop"
    assert isinstance(json.loads(plan.text("content")), dict)
    squeezed = _plan(Constraint("json_object", True), thinking="enabled", max_tokens=4)
    assert squeezed.finish_reason == "length" and squeezed.total_tokens == 4


@pytest.mark.parametrize(("schema", "problem"), [  # llguidance's words, as vLLM 0.32's auto backend reports them
    ({"type": ["string", "nonsense"]}, "Invalid type: nonsense"),
    ({"type": 5}, "type must be a string or array of strings"),
    ({"type": "array", "items": "x"}, "schema must be an object or boolean"),
    ({"type": "object", "properties": {"a": "string"}}, "schema must be an object or boolean"),
    ({"enum": "a"}, "enum must be an array"),
    ({"enum": []}, "Unsatisfiable schema: anyOf is empty"),
    ({"type": "string", "minLength": 5, "maxLength": 2},
     "Unsatisfiable schema: minLength (5) is greater than maxLength (2)"),
    ({"type": "array", "minItems": 5, "maxItems": 2},
     "Unsatisfiable schema: minItems (5) is greater than maxItems (2)"),
    ({"type": "number", "minimum": 10.5, "maximum": 2.25},
     "Unsatisfiable schema: minimum (10.5) is greater than maximum (2.25)"),
    ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 5},
     "Unsatisfiable schema: exclusiveMinimum (5) is equal to exclusiveMaximum (5)"),
    ({"type": "object", "minProperties": 3, "maxProperties": 1}, "Unsatisfiable schema: minProperties > maxProperties"),
    ({"type": "object", "additionalProperties": "x"}, "schema must be an object or boolean"),
    ({"type": "string", "format": "binary"}, "Unknown format: binary"),
    ({"$defs": {"A": {"type": "nonsense"}}, "$ref": "#/$defs/A"}, "Invalid type: nonsense"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ({"type": "integer", "multipleOf": 0}, "invalid multiple of"),
    ({"type": "number", "minimum": 10.0, "maximum": 2.5e-7},
     "Unsatisfiable schema: minimum (10) is greater than maximum (0.00000025)"),
    ({"type": "number", "minimum": 1e21, "maximum": 3},
     "Unsatisfiable schema: minimum (1000000000000000000000) is greater than maximum (3)"),
    ({"type": "string", "pattern": "("}, "regex parse error:\n    (\n    ^\nerror: unclosed group"),
    ({"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 1}, "minItems": 1},
     "Unsatisfiable schema: required item is unsatisfiable"),
    ({"type": "object", "properties": {"a": {"type": "object", "minProperties": 3, "maxProperties": 1}},
      "required": ["a"]}, "Unsatisfiable schema: required property 'a' is unsatisfiable"),
])
def test_schemas_vllm_refuses(schema: dict[str, Any], problem: str) -> None:
    assert schema_problem(schema, schema) == problem
    with pytest.raises(ApiError) as refused:
        validate(Constraint("json", schema))
    assert refused.value.status == 400 and refused.value.message == f"Grammar error: {problem}"


@pytest.mark.parametrize("schema", [  # accepted by vLLM 0.32 (xgrammar compiles them)
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
    {"type": "object", "foo": 1},
    {"anyOf": []},
    {"type": "string", "format": "json-pointer"},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 1}}},  # optional: left out
    {"type": "array", "items": {"type": "string", "minLength": 5, "maxLength": 2}},  # no items then
    {"anyOf": [{"type": "integer", "minimum": 3, "maximum": 1}, {"type": "string"}]},
    {"not": {"type": "nonsense"}},  # xgrammar ignores `not`
    {"$defs": {"A": {"type": "nonsense"}}, "type": "string"},  # a definition nothing refers to is not compiled
])
def test_schemas_vllm_accepts(schema: dict[str, Any]) -> None:
    assert schema_problem(schema, schema) is None


def test_other_constraint_checks() -> None:
    for constraint, message in [
        (Constraint("json", "{not json"), "Invalid JSON grammar specification."),
        (Constraint("json", "  "), "structured_outputs.json cannot be an empty string"),
        (Constraint("grammar", ""), "structured_outputs.grammar cannot be an empty string"),
        (Constraint("json_object", False), "structured_outputs.json_object must be True if set; omit "
                                           "structured_outputs to disable structured outputs"),
    ]:
        with pytest.raises(ApiError) as refused:
            validate(constraint)
        assert refused.value.message == message
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ApiError) as refused:
        validate(Constraint("json", deep))
    assert refused.value.message == ("The JSON schema is nested too deeply: objects and arrays may nest at most 64 "
                                     "levels")
    validate(Constraint("json", json.dumps({"type": "object"})))  # a schema given as JSON text is fine


def test_write_is_reproducible_from_the_rng() -> None:
    constraint = Constraint("json", PYDANTIC_NESTED)
    assert write(constraint, random.Random(3)) == write(constraint, random.Random(3))
