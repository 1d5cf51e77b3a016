"""MkDocs hook: the pages that must never drift from the code are generated from it at build time.

- `reference/configuration.md`: every key of `policies.config.GatewayConfig` (type, default, description), walked
  from the pydantic model itself, so a new, renamed or retyped key shows up the next time the site is built.
- `reference/http-api.md`: a table of every path and operation of `deploy/openapi.yaml`; the file itself is
  included in the page by pymdownx.snippets (nothing is fetched at view time: no Swagger UI from a CDN).
- `<!-- rendered-commands -->` in deployment.md: `m3gate pools render` of the compose pool files, the recipe's
  `vllm serve` flags exactly as the gateway renders them today.
- `<!-- layers -->` in architecture.md: the import-linter layers of pyproject.toml, each module with the first line
  of its docstring (read with `ast`: nothing of the gateway is imported to build the table).

Wired in mkdocs.yml (`hooks:`); `make docs` runs `mkdocs build --strict`, so a warning logged here fails the build.
"""

from __future__ import annotations

import ast
import logging
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.generate")

# Descriptions for the keys the model gives none (mostly self-explanatory scalars); keyed by dotted path with `[]`
# for list items and `.*` for mapping values. A key listed here that the model no longer has fails the build.
EXTRA_DESCRIPTIONS: dict[str, str] = {
    "pools[].discovery.scheme": "URL scheme of the discovered replicas.",
    "classification.exact_count_near_boundary": "Near a pool's limit (boundary_band), ask the pool's /tokenize for "
    "the exact count instead of trusting the estimate.",
    "classification.output_budget": "Output tokens reserved, per thinking mode, when a request names no max_tokens.",
    "classification.output_budget.enabled": "Reserve for thinking_mode: enabled.",
    "classification.output_budget.adaptive": "Reserve for thinking_mode: adaptive.",
    "classification.output_budget.disabled": "Reserve for thinking_mode: disabled.",
    "classification.image_tokens_max": "Upper bound of one image's token estimate.",
    "classification.video_tokens_default": "Tokens for a video whose size is unknown.",
    "routing": "How a replica is chosen within the chosen pool.",
    "server": "The gateway's listener and its upstream timeouts.",
    "server.host": "Listen address (env M3GATE_HOST).",
    "server.port": "Listen port (env M3GATE_PORT); 0 picks a free one.",
    "server.upstream_connect_timeout_s": "Longest TCP connect to a replica; beyond it the attempt fails (and is "
    "retried elsewhere before the first byte).",
    "server.health_interval_s": "Active /health + /metrics poll interval per replica.",
    "telemetry.tracing": "OpenTelemetry tracing (see Observability, \"Traces\").",
    "traffic.saturation": "When a replica counts as saturated, from its scraped vLLM metrics.",
    "access.keys": "Client API keys, each stored as its sha256.",
    "pools[].launch.tensor_parallel_size": "vLLM's --tensor-parallel-size.",
    "pools[].launch.data_parallel_size": "vLLM's --data-parallel-size.",
    "pools[].launch.collect_detailed_traces": "vLLM's --collect-detailed-traces (needs otlp_traces_endpoint).",
}

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _type_name(tp: Any) -> str:
    """A short, YAML-minded name for an annotation: `list[string]`, `"a" | "b"`, `PoolConfig`."""
    from pydantic import SecretStr

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else f"`{a!r}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return f"map[{_type_name(args[0])} → {_type_name(args[1])}]"
    if tp is SecretStr:
        return "secret string"
    if tp in _SCALARS:
        return _SCALARS[tp]
    if _is_model(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _nested_models(tp: Any) -> list[tuple[str, type]]:
    """Sub-models reachable from an annotation, with the path suffix that reaches them (`[]` list item, `.*` value)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_model(tp):
        return [("", tp)]
    if origin in (typing.Union, types.UnionType):
        return [m for a in args for m in _nested_models(a)]
    if origin in (list, tuple, set, frozenset) and args:
        return [("[]" + s, m) for s, m in _nested_models(args[0])]
    if origin is dict and len(args) == 2:
        return [(".*" + s, m) for s, m in _nested_models(args[1])]
    return []


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "computed"
        if _is_model(type(value)):
            return "see below"
        if isinstance(value, dict) and value and all(_is_model(type(v)) for v in value.values()):
            return ", ".join(f"`{k}`" for k in value) + " (see below)"
        return f"`{value!r}`" if value not in ([], {}, ()) else "empty"
    if field.default in ((), [], {}):
        return "empty"
    if field.default is PydanticUndefined:
        return "**required**"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _constraints(field: Any) -> str:
    """Bounds pydantic checks (`> 0`, `≤ 65535`, `1–64 items`), appended to the type."""
    marks = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            bound = getattr(meta, attr, None)
            if bound is not None:
                marks.append(f"{sign} {bound:,}" if isinstance(bound, int) else f"{sign} {bound}")
        if getattr(meta, "min_length", None):
            marks.append(f"at least {meta.min_length} item(s)" if field.annotation is not str else
                         f"at least {meta.min_length} character(s)")
        if getattr(meta, "max_length", None):
            marks.append(f"at most {meta.max_length:,} characters")
    return f", {' and '.join(marks)}" if marks else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc(model: type) -> str:
    doc = model.__doc__ or ""
    return " ".join(doc.split()) if doc and not doc.startswith(("Usage docs:", "!!! abstract")) else ""


def config_reference_markdown() -> str:
    """The configuration reference page: one table per (sub-)model, in the order the YAML nests them."""
    sys.path.insert(0, str(ROOT))
    from policies.config import ENV_OVERRIDES, GatewayConfig

    used: set[str] = set()
    sections: list[str] = []
    documented: dict[type, str] = {GatewayConfig: ""}

    def walk(prefix: str, model: type) -> None:
        rows = []
        children: list[tuple[str, type]] = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            description = field.description or EXTRA_DESCRIPTIONS.get(key, "")
            if not description and _nested_models(field.annotation):
                summary = _doc(_nested_models(field.annotation)[0][1]).split(". ")[0].rstrip(".")
                description = summary + "." if summary else ""
            if key in EXTRA_DESCRIPTIONS:
                used.add(key)
            tp = field.annotation
            type_name = _type_name(tp) + _constraints(field)
            for suffix, sub_model in _nested_models(tp):
                # A model met again (a launch spec per role, three percentile sets) links to its first table.
                sub = documented.setdefault(sub_model, key + suffix)
                if sub == key + suffix:
                    children.append((sub, sub_model))
                type_name += f" ([`{sub}`](#{_anchor(sub)}))"
            rows.append(f"| `{name}` | {type_name} | {_default(field)} | {_cell(description)} |")
        title = prefix or "top level"
        lines = [f"## `{title}`" if prefix else "## Top level", ""]
        if _doc(model):
            lines += [_doc(model), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
        sections.append("\n".join(lines))
        for child_prefix, child in children:
            walk(child_prefix, child)

    walk("", GatewayConfig)
    stale = sorted(set(EXTRA_DESCRIPTIONS) - used)
    if stale:
        log.warning("docs/hooks/generate.py describes config keys the model no longer has: %s", stale)

    env_rows = "\n".join(f"| `{var}` | `{'.'.join(path)}` |" for var, path in ENV_OVERRIDES.items())
    head = f"""# Configuration reference

Every key of the pool file, generated from the pydantic model `policies/config.py` (`GatewayConfig`) each time
the site is built, so it cannot drift from the code. Unknown keys are errors; `m3gate config check FILE` names
each bad field with its line, and `m3gate config schema` prints the same model as a JSON schema for editors
(committed as `deploy/m3gate.schema.json`). [Configuration](../configuration.md) explains the file with examples.

"Unset" is YAML `null` (or the key left out). Durations end in `_s` (seconds) or `_ms`.

## Environment variables

| variable | overrides |
|---|---|
{env_rows}
| `M3GATE_POOL_<NAME>_API_KEY` | `pools[].api_key` of pool NAME (upper case, `-` and `.` as `_`) |
| `M3GATE_POOL_API_KEY` | `pools[].api_key` of every pool without its own variable |

"""
    return head + "\n".join(sections)


def _anchor(key: str) -> str:
    """The id MkDocs' toc extension gives a `## \\`key\\`` heading."""
    out = []
    for ch in key.lower():
        if ch.isalnum() or ch in "_-":
            out.append(ch)
        elif ch in " ":
            out.append("-")
    return "".join(out)


def http_api_markdown() -> str:
    """Paths and operations of deploy/openapi.yaml as a table, then the file itself (via pymdownx.snippets)."""
    spec = yaml.safe_load((ROOT / "deploy" / "openapi.yaml").read_text())
    info = spec.get("info", {})
    rows = []
    for path, item in spec.get("paths", {}).items():
        for method, op in item.items():
            if method not in {"get", "post", "put", "delete", "patch"}:
                continue
            responses = op.get("responses", {})
            ok = _resolve(spec, next((r for c, r in responses.items() if str(c).startswith("2")), {}) or {})
            what = op.get("summary") or _first_sentence(op.get("description") or "") or ok.get("description") or ""
            body = (op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" in body:
                what = f"Body `{body['$ref'].rsplit('/', 1)[-1]}`. " + what
            codes = ", ".join(str(c) for c in responses)
            rows.append(f"| `{method.upper()}` | `{path}` | `{op.get('operationId', '')}` | {_cell(what)} | {codes} |")
    return f"""# HTTP API

The gateway's HTTP surface as described by `deploy/openapi.yaml` (OpenAPI {spec.get('openapi', '')}, "{info.get('title', '')}"
{info.get('version', '')}). The table is generated from the file when the site is built; the file follows in full.
The fuzz suite (`make fuzz`, [Reliability](../reliability.md#hostile-and-malformed-input)) generates its cases
from it. Every refusal is an OpenAI-shaped error, `{{"error": {{"message", "type", "param", "code"}}}}`.

| method | path | operationId | what | responses |
|---|---|---|---|---|
{chr(10).join(rows)}

## `deploy/openapi.yaml`

```yaml
--8<-- "deploy/openapi.yaml"
```
"""


def _resolve(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """Follow a local `$ref` (`#/components/...`) to what it names."""
    ref = node.get("$ref", "")
    if not ref.startswith("#/"):
        return node
    for part in ref[2:].split("/"):
        spec = spec.get(part, {})
    return spec


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    return flat.split(". ")[0].rstrip(".") + "." if flat else ""


# The top-level packages have no docstring of their own; the architecture page says what each holds.
PACKAGES = {
    "loadtests": "lib/ (workloads, load generator, trace replay, reports), bench/ (the benchmarks), robustness/ (chaos, "
                 "fuzz, soak), assets/ (the docs' pictures); may import anything below.",
    "gateway": "HTTP and the coordinator: one request's path, the process's runtime and its collaborators.",
    "pools": "The outside world: replicas, health and metrics scraping, prefix indexes, KV events, Redis shared "
             "state, rate limits, DNS, the simulator, the vLLM launcher.",
    "policies": "Pure decisions, no I/O: classification, pool and replica choice, admission, the config model.",
}


def layers_markdown() -> str:
    """The import-linter layers of pyproject.toml with each module's docstring summary."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = {c["id"]: c for c in project["tool"]["importlinter"]["contracts"]}
    out = []
    packages = contracts["packages"]
    out.append(f"**{packages['name']}**\n")
    out.append("| layer | package | what |\n|---|---|---|")
    for i, name in enumerate(packages["layers"], 1):
        what = _summary(ROOT / name / "__init__.py") or PACKAGES.get(name, "")
        out.append(f"| {i} | `{name}/` | {_cell(what)} |")
    for cid in ("gateway", "policies"):
        out.extend(_contract_table(contracts[cid], cid))
        # then each subpackage's own contract (ids "gateway-<package>"), in the order the package's layers name them
        for layer in contracts[cid]["layers"]:
            for module in (m.strip() for m in layer.split("|")):
                if f"{cid}-{module}" in contracts:
                    out.extend(_contract_table(contracts[f"{cid}-{module}"], f"{cid}/{module}"))
    return "\n".join(out) + "\n"


def _contract_table(contract: dict[str, Any], folder: str) -> list[str]:
    """One contract as a table: its layers (an independence contract: one layer of independent modules), each
    module (or subpackage, named by its folder) with its docstring summary."""
    layers = contract.get("layers") or [" | ".join(m.rsplit(".", 1)[1] for m in contract["modules"])]
    out = [f"\n**{contract['name']}**\n", "| layer | module | what |\n|---|---|---|"]
    for i, layer in enumerate(layers, 1):
        for module in (m.strip() for m in layer.split("|")):
            package = (ROOT / folder / module).is_dir()
            path, shown = (ROOT / folder / module / "__init__.py", f"{folder}/{module}/") if package else \
                (ROOT / folder / f"{module}.py", f"{folder}/{module}.py")
            out.append(f"| {i} | `{shown}` | {_cell(_summary(path))} |")
    return out


def rendered_commands_markdown() -> str:
    """`m3gate pools render` of the compose deployment's pool files: the recipe's flags as the gateway renders them."""
    sys.path.insert(0, str(ROOT))
    from policies.config import load_config
    from policies.launch import format_commands, render_config

    out = []
    for name in ("pools.yaml", "pools.pd.yaml"):
        path = ROOT / "deploy" / "compose" / name
        text = format_commands(render_config(load_config(path, env={})), "shell")
        out.append(f"`m3gate pools render deploy/compose/{name}`:\n\n```bash\n{text.rstrip()}\n```\n")
    return "\n".join(out)


def _summary(path: Path) -> str:
    if not path.is_file():
        log.warning("docs/hooks/generate.py: %s is named in pyproject's layers but does not exist", path)
        return ""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split())


# ---- MkDocs events -------------------------------------------------------------------------------------------


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/configuration.md", content=config_reference_markdown()))
    files.append(File.generated(config, "reference/http-api.md", content=http_api_markdown()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if "<!-- layers -->" in markdown:
        markdown = markdown.replace("<!-- layers -->", layers_markdown())
    if "<!-- rendered-commands -->" in markdown:
        # Indented like its marker, so the block can sit inside an admonition.
        def indented(match: re.Match[str]) -> str:
            return "\n".join(match.group(1) + line if line else line
                             for line in rendered_commands_markdown().splitlines())
        markdown = re.sub(r"^( *)<!-- rendered-commands -->$", indented, markdown, flags=re.MULTILINE)
    return markdown
