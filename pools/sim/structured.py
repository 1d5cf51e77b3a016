"""Structured output as vLLM 0.32 constrains it: which request fields ask for it, the 400s it answers, and the text.

vLLM turns `response_format` (chat, completions), `text.format` (Responses), `output_config.format` (Messages)
and `structured_outputs` into one `StructuredOutputsParams` (`entrypoints/generate/base/protocol.py:
structured_outputs_from_response_format`), checks it where it builds the sampling parameters
(`SamplingParams._validate_structured_outputs`, the "auto" backend: xgrammar, then llguidance) and constrains the
tokens after the reasoning ends. The simulator answers the same
requests with the same 400s, and writes the constrained text itself: a JSON object for `json_object`, a value that
validates against the schema for `json`, one of the `choice` strings. `regex`, `grammar` and `structural_tag` are
accepted and answered with unconstrained text. The old `guided_*` fields are ignored, as vLLM 0.32 ignores them.
"""

from __future__ import annotations

import json
import math
import random
import re
import re._parser as sre_parse  # the regex parse tree a pattern's example string is written from
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pools.sim.protocol import bad_request, vllm_validation_error

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = (("disable_any_whitespace", False), ("disable_additional_properties", False), ("whitespace_pattern", None))
MAX_JSON_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING


@dataclass(frozen=True)
class Constraint:
    """What the tokens after the reasoning must match: `kind` is one of `_KINDS`, `spec` its value."""

    kind: str
    spec: Any

    @property
    def constrains_text(self) -> bool:
        """Whether the simulator writes the constrained text (json, json_object, choice) or prose."""
        return self.kind in ("json", "json_object", "choice")


def _params_repr(params: dict[str, Any]) -> str:
    """`StructuredOutputsParams.__dict__` as vLLM prints it in its count errors."""
    fields = {k: params.get(k) for k in _KINDS[:5]}
    fields.update({k: params.get(k, default) for k, default in _OPTIONS})
    fields["structural_tag"] = params.get("structural_tag")
    fields.update({"_backend": None, "_backend_was_auto": False})
    return str(fields)


def _constraint(params: dict[str, Any]) -> Constraint:
    """StructuredOutputsParams.__post_init__: exactly one kind of constraint."""
    given = [k for k in _KINDS if params.get(k) is not None]
    if len(given) > 1:
        raise bad_request("You can only use one kind of structured outputs constraint but multiple are specified: "
                          + _params_repr(params))
    if not given:
        raise bad_request("You must use one kind of structured outputs constraint but none are specified: "
                          + _params_repr(params))
    return Constraint(given[0], params[given[0]])


def check_params(structured_outputs: Any) -> None:
    """The request's own `structured_outputs` object, checked as pydantic builds it (after the before-validators)."""
    if isinstance(structured_outputs, dict):
        _constraint(structured_outputs)


def from_request(structured_outputs: Any, response_format: Any) -> Constraint | None:
    """`structured_outputs_from_response_format`: the response_format (a validated model) overrides the kind."""
    params = dict(structured_outputs) if isinstance(structured_outputs, dict) else None
    kind = getattr(response_format, "type", None)
    if kind is None or kind == "text":
        return _constraint(params) if params is not None else None
    if kind == "json_object":
        overrides: dict[str, Any] = {"json_object": True}
    elif kind == "json_schema":
        overrides = {"json": response_format.json_schema.json_schema}
    else:
        overrides = {"structural_tag": json.dumps(response_format.model_dump(by_alias=True))}
    return _constraint({**(params or {}), **overrides})


def from_responses(structured_outputs: Any, text: Any) -> Constraint | None:
    """ResponsesRequest.extract_structured_outputs: `text.format` or `structured_outputs`, not both."""
    fmt = getattr(text, "format", None)
    if fmt is None:
        return _constraint(structured_outputs) if isinstance(structured_outputs, dict) else None
    if structured_outputs is not None:
        raise vllm_validation_error("Cannot specify both structured_outputs and text.format", "structured_outputs")
    if fmt.type == "json_object":
        return Constraint("json_object", True)
    if fmt.type == "json_schema" and fmt.schema_ is not None:
        return Constraint("json", fmt.schema_)
    return None


def from_messages(output_config: Any) -> Constraint | None:
    """The Anthropic Messages API's `output_config.format` (`{"type": "json_schema", "schema": …}`), which vLLM
    turns into a json_schema response_format."""
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    return Constraint("json", schema) if isinstance(schema, dict) and schema else None


def _nested_deeper(spec: Any, limit: int) -> bool:
    """vLLM's `_exceeds_json_nesting`: objects and arrays nested more than `limit` levels."""
    level = [spec]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node) if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def validate(constraint: Constraint | None) -> None:
    """SamplingParams._validate_structured_outputs with the "auto" backend, for what a request can get wrong."""
    if constraint is None:
        return
    kind, spec = constraint.kind, constraint.spec
    if kind == "choice" and isinstance(spec, list) and not spec:
        raise bad_request(f"Choice '{spec}' cannot be an empty list")
    if kind in ("grammar", "json", "structural_tag") and isinstance(spec, str) and not spec.strip():
        raise bad_request(f"structured_outputs.{kind} cannot be an empty string")
    if kind in ("json", "structural_tag") and spec:
        loaded = spec
        if isinstance(spec, str):
            try:
                loaded = json.loads(spec)
            except RecursionError:
                loaded = None
            except ValueError:
                loaded = spec
        limit = MAX_JSON_NESTING + (2 if kind == "structural_tag" else 0)
        if loaded is None or (not isinstance(loaded, str) and _nested_deeper(loaded, limit)):
            raise bad_request(f"The JSON schema is nested too deeply: objects and arrays may nest at most "
                              f"{MAX_JSON_NESTING} levels")
    if kind == "json_object" and spec is False:
        raise bad_request("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                          "structured outputs")
    if kind == "json":
        schema = spec
        if isinstance(spec, str):
            try:
                schema = json.loads(spec)
            except ValueError:
                raise bad_request("Invalid JSON grammar specification.") from None
        problem = schema_problem(schema, schema)
        if problem is not None:
            raise bad_request(f"Grammar error: {problem}")


_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "json-pointer"})  # what xgrammar compiles; llguidance refuses the others
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "contains", "propertyNames", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"))


def _number(value: Any) -> str:
    """A bound as llguidance prints it (Rust's f64 Display: shortest digits, never an exponent)."""
    if isinstance(value, int):
        return str(value)
    return format(Decimal(repr(value)).normalize(), "f")


def _bound_problem(schema: dict[str, Any]) -> str | None:
    for low, high in _BOUNDS:
        lo, hi = schema.get(low), schema.get(high)
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
            return f"{low} ({_number(lo)}) is greater than {high} ({_number(hi)})"
    lo, hi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo >= hi:
        word = "equal to" if lo == hi else "greater than"
        return f"exclusiveMinimum ({_number(lo)}) is {word} exclusiveMaximum ({_number(hi)})"
    lo, hi = schema.get("minProperties"), schema.get("maxProperties")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        return "minProperties > maxProperties"
    if schema.get("enum") == []:
        return "anyOf is empty"
    return None


def _keyword_problem(schema: dict[str, Any], root: Any) -> str | None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not (isinstance(kind, str) or (isinstance(kind, list)
                                                            and all(isinstance(k, str) for k in kind))):
        return "type must be a string or array of strings"
    bad = next((k for k in kinds if k is not None and k not in _TYPES), None)
    if bad is not None:
        return f"Invalid type: {bad}"
    if "properties" in schema and not isinstance(schema["properties"], dict):
        return "properties must be an object"
    if "required" in schema and not isinstance(schema["required"], list):
        return f"Expected array for 'required', got {json.dumps(schema['required'])}"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return "enum must be an array"
    if "uniqueItems" in schema:  # xgrammar declines it (vLLM's check), llguidance does not implement it
        return 'Unimplemented keys: ["uniqueItems"]'
    if schema.get("multipleOf") == 0:
        return "invalid multiple of"
    fmt = schema.get("format")
    if isinstance(fmt, str) and "string" in kinds and fmt not in FORMATS:
        return f"Unknown format: {fmt}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and _resolve(root, ref) is None:
        return f"Pointer '{ref[1:]}' does not exist"
    pattern = schema.get("pattern")
    return _regex_problem(pattern) if isinstance(pattern, str) else None


_RUST_REGEX_ERRORS = {"missing ), unterminated subpattern": "unclosed group",
                      "unterminated character set": "unclosed character class"}


def _regex_problem(pattern: str) -> str | None:
    """The regex crate's report of a pattern that does not parse, for the mistakes it words like Python's `re`
    (an unclosed group or character class); other patterns are accepted."""
    try:
        re.compile(pattern)
    except re.error as exc:
        words = _RUST_REGEX_ERRORS.get(exc.msg)
        if words is not None and exc.pos is not None and "\n" not in pattern:
            return f"regex parse error:\n    {pattern}\n    {' ' * exc.pos}^\nerror: {words}"
    return None


def schema_problem(schema: Any, root: Any) -> str | None:
    """llguidance's complaint about a JSON schema (its words), or None when vLLM compiles it. Covers the mistakes a
    client makes: unknown types and formats, misshapen keywords, dangling `$ref`s anywhere; contradictory bounds
    where they leave no value (the root, or a required property: an optional property or an array's items that
    cannot be satisfied are left out, as llguidance leaves them)."""
    problem = _structural_problem(schema, root)
    if problem is not None:
        return problem
    reason = unsatisfiable(schema, root)
    return None if reason is None else f"Unsatisfiable schema: {reason}"


def _structural_problem(schema: Any, root: Any, seen: set[str] | None = None) -> str | None:
    """The first misshapen keyword in `schema` or a subschema it uses (`$ref` targets once each; definitions no
    `$ref` points at are not compiled)."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return "schema must be an object or boolean"
    problem = _keyword_problem(schema, root)
    if problem is not None:
        return problem
    seen = set() if seen is None else seen
    children: list[Any] = list((schema.get("properties") or {}).values())
    children += [schema[k] for k in _SUBSCHEMA_KEYS if k in schema and not (k == "items" and
                                                                             isinstance(schema[k], list))]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += schema[key]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen:
        seen.add(ref)
        children.append(_resolve(root, ref) if ref.startswith("#") else True)
    for child in children:
        problem = _structural_problem(child, root, seen)
        if problem is not None:
            return problem
    return None


def unsatisfiable(schema: Any, root: Any, depth: int = 0) -> str | None:
    """Why no value meets `schema` (llguidance's words, without the "Unsatisfiable schema: " prefix), or None."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    schema = _merged(schema, root)
    reason = _bound_problem(schema)
    if reason is not None:
        return reason
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for name in schema.get("required") or []:
        if name in props and unsatisfiable(props[name], root, depth + 1) is not None:
            return f"required property '{name}' is unsatisfiable"
    items = schema.get("items")
    if isinstance(schema.get("minItems"), int) and schema["minItems"] > 0 and isinstance(items, dict) \
            and unsatisfiable(items, root, depth + 1) is not None:
        return "required item is unsatisfiable"
    return None


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer (`#/$defs/Name`) into the root schema; None when it points nowhere."""
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# ---- the constrained text ------------------------------------------------------------------------------------

_WORDS = ("simulated", "answer", "value", "replica", "token", "example", "structured", "output", "field", "text")
_FORMAT_VALUES = {"date-time": "2026-01-15T09:30:00Z", "date": "2026-01-15", "time": "09:30:00Z", "duration": "P1D",
                  "email": "user@example.com", "hostname": "example.com", "ipv4": "192.0.2.1", "ipv6": "2001:db8::1",
                  "uri": "https://example.com/item", "uri-reference": "/item", "json-pointer": "/item"}
_MAX_DEPTH = 8  # recursive schemas: below this, only what is required


def write(constraint: Constraint, rng: random.Random) -> str:
    """The text a constrained model writes: JSON for json / json_object, one choice for choice."""
    if constraint.kind == "choice":
        return str(rng.choice(constraint.spec))
    if constraint.kind == "json_object":
        value: Any = {"answer": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))}
    else:
        schema = constraint.spec
        if isinstance(schema, str):
            schema = json.loads(schema)
        value = _value(schema, schema, rng, 0)
    return json.dumps(value, ensure_ascii=False)


def _merged(schema: dict[str, Any], root: Any) -> dict[str, Any]:
    """`$ref` followed and `allOf` folded in, so one schema says what the value must be."""
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < 32:
        target = _resolve(root, schema["$ref"])
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**(target if isinstance(target, dict) else {}), **rest}
        seen += 1
    for part in schema.get("allOf") or []:
        part = _merged(part, root) if isinstance(part, dict) else {}
        props = {**(schema.get("properties") or {}), **(part.get("properties") or {})}
        required = list(dict.fromkeys([*(schema.get("required") or []), *(part.get("required") or [])]))
        schema = {**part, **{k: v for k, v in schema.items() if k != "allOf"}, "properties": props,
                  "required": required}
    return schema


def _kind(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _value(schema: Any, root: Any, rng: random.Random, depth: int) -> Any:
    if not isinstance(schema, dict):
        return "value" if schema is not False else None
    schema = _merged(schema, root)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        kept = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")
                and unsatisfiable(b, root) is None]
        branch = kept[0] if kept and depth < _MAX_DEPTH else branches[0]
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return _value({**rest, **branch} if isinstance(branch, dict) else branch, root, rng, depth)
    kind = _kind(schema)
    if kind == "object":
        return _object(schema, root, rng, depth)
    if kind == "array":
        return _array(schema, root, rng, depth)
    if kind in ("integer", "number"):
        return _number_value(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def _object(schema: dict[str, Any], root: Any, rng: random.Random, depth: int) -> dict[str, Any]:
    props = schema.get("properties") or {}
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    names = [p for p in props if p in required or (depth < _MAX_DEPTH and unsatisfiable(props[p], root) is None)]
    names += [r for r in required if r not in names]
    value = {name: _value(props.get(name, {}), root, rng, depth + 1) for name in names}
    extra = schema.get("additionalProperties", True)
    wanted = schema.get("minProperties", 0)
    while len(value) < wanted and extra is not False:
        value[f"{rng.choice(_WORDS)}_{len(value)}"] = _value(extra if isinstance(extra, dict) else {}, root, rng,
                                                            depth + 1)
    return value


def _array(schema: dict[str, Any], root: Any, rng: random.Random, depth: int) -> list[Any]:
    prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
    low = max(int(schema.get("minItems", 0)), len(prefix))
    high = max(low, int(schema.get("maxItems", len(prefix) if schema.get("items") is False else max(low, 3))))
    items = schema.get("items", {}) if isinstance(schema.get("items", {}), dict) else {}
    if depth >= _MAX_DEPTH or unsatisfiable(items, root) is not None:
        high = low  # no more items than required: llguidance leaves out what it cannot satisfy
    count = rng.randint(min(max(low, 1), high), high)
    values: list[Any] = []
    for i in range(count):
        item = prefix[i] if i < len(prefix) else items
        value = _value(item, root, rng, depth + 1)
        if schema.get("uniqueItems") and value in values:
            value = _value(item, root, random.Random(rng.random()), depth + 1)
            if value in values and len(values) >= low:
                break
        values.append(value)
    return values


def _number_value(schema: dict[str, Any], rng: random.Random, integer: bool) -> int | float:
    """A number inside the schema's bounds (the stricter of inclusive and exclusive), 0..100 when unbounded."""
    step = 1 if integer else 0.01
    lows = [schema["minimum"]] if isinstance(schema.get("minimum"), (int, float)) else []
    lows += [schema["exclusiveMinimum"] + step] if isinstance(schema.get("exclusiveMinimum"), (int, float)) else []
    highs = [schema["maximum"]] if isinstance(schema.get("maximum"), (int, float)) else []
    highs += [schema["exclusiveMaximum"] - step] if isinstance(schema.get("exclusiveMaximum"), (int, float)) else []
    high = min(highs) if highs else None
    low = max(lows) if lows else (0 if high is None else min(0, high - 100))
    high = low + 100 if high is None else high
    if integer:
        low, high = math.ceil(low), math.floor(high)
        return rng.randint(low, max(low, high))
    return min(max(round(rng.uniform(low, max(low, high)), 2), low), high)


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if fmt in _FORMAT_VALUES:
        return _FORMAT_VALUES[fmt]
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        matching = _matching(pattern, rng)
        if matching is not None:
            return matching
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    while len(text) < low:
        text += " " + rng.choice(_WORDS)
    if isinstance(high, int):
        text = text[:high].rstrip() if len(text[:high].rstrip()) >= low else text[:high]
    return text


def _matching(pattern: str, rng: random.Random) -> str | None:
    """A string that `pattern` matches, written from its parse tree (literals, classes, repeats, groups,
    alternatives); None for what that cannot write (lookarounds, back-references) or a pattern that does not parse."""
    try:
        text = "".join(_from_tree(sre_parse.parse(pattern), rng))
    except (re.error, ValueError, KeyError, IndexError, RecursionError):
        return None
    return text if re.search(pattern, text) else None


def _from_tree(tree: Any, rng: random.Random) -> list[str]:
    out: list[str] = []
    for op, arg in tree:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "NOT_LITERAL":
            out.append("a" if chr(arg) != "a" else "b")
        elif name == "ANY":
            out.append(rng.choice("abcxyz"))
        elif name == "IN":
            out.append(_from_class(arg, rng))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            for _ in range(rng.randint(low, min(high, low + 3))):
                out += _from_tree(sub, rng)
        elif name == "SUBPATTERN":
            out += _from_tree(arg[-1], rng)
        elif name == "BRANCH":
            out += _from_tree(rng.choice(arg[1]), rng)
        elif name == "CATEGORY":
            out.append(_CATEGORIES[str(arg)])
        elif name != "AT":
            raise ValueError(name)
    return out


_CATEGORIES = {"CATEGORY_DIGIT": "7", "CATEGORY_WORD": "w", "CATEGORY_SPACE": " ", "CATEGORY_NOT_DIGIT": "x",
               "CATEGORY_NOT_WORD": "-", "CATEGORY_NOT_SPACE": "s"}


def _from_class(items: Any, rng: random.Random) -> str:
    if items and str(items[0][0]) == "NEGATE":
        for candidate in "aZ7_- .":
            if re.fullmatch(f"[{_class_source(items[1:])}]", candidate) is None:
                return candidate
        raise ValueError("class")
    op, arg = rng.choice(items)
    name = str(op)
    if name == "LITERAL":
        return chr(arg)
    if name == "RANGE":
        return chr(rng.randint(arg[0], arg[1]))
    if name == "CATEGORY":
        return _CATEGORIES[str(arg)]
    raise ValueError(name)


def _class_source(items: Any) -> str:
    parts = []
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            parts.append(re.escape(chr(arg)))
        elif name == "RANGE":
            parts.append(f"{re.escape(chr(arg[0]))}-{re.escape(chr(arg[1]))}")
        elif name == "CATEGORY":
            parts.append({"CATEGORY_DIGIT": r"\d", "CATEGORY_WORD": r"\w", "CATEGORY_SPACE": r"\s"}.get(str(arg), ""))
    return "".join(parts)
