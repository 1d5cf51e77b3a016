"""The disaggregated deploy examples, offline: deploy/compose/compose.pd.yaml (+ pools.pd.yaml) against the
compose-spec schema, and the deploy/k8s/disaggregated overlay against the Kubernetes schemas; each role's replicas
run exactly `m3gate pools render`'s command, the pool file finds them, NIXL's side channel is wired."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from policies.config import load_config
from policies.launch import render
from tests.support.kustomize import kustomized

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
OVERLAY = ROOT / "deploy" / "k8s" / "disaggregated"
K8S_VERSION = "1.32.0"
Obj = dict[str, Any]


# ---- compose ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pd_compose() -> Obj:
    return yaml.safe_load((COMPOSE / "compose.pd.yaml").read_text())


def test_compose_override_matches_the_compose_spec(pd_compose: Obj) -> None:
    schema = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(pd_compose))
    assert not errors, [e.message for e in errors]


def test_compose_pool_services_run_the_rendered_commands(pd_compose: Obj) -> None:
    cfg = load_config(COMPOSE / "pools.pd.yaml", env={})
    (pool,) = cfg.pools
    d = pool.disaggregation
    assert d is not None and not pool.endpoints
    services = pd_compose["services"]
    commands = render(pool, cfg.model)
    assert {c.role for c in commands} == {"prefill", "decode"}
    gpus: list[str] = []
    for c in commands:
        name = f"pool-{c.name}"
        svc = services[name]
        assert svc["entrypoint"] + svc["command"] == c.argv, f"{name}: re-paste `m3gate pools render pools.pd.yaml`"
        assert svc["profiles"] == ["gpu-pd"]
        env = svc["environment"]
        assert {k: str(env.get(k)) for k in c.env} == c.env
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name  # reachable from the other replica by its service name
        assert f"http://{name}:{c.port}" in getattr(d, c.role).endpoints
        devices = svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        assert len(devices) == c.gpus
        gpus += devices
    assert len(gpus) == len(set(gpus)) <= 8, "the two roles share no GPU of the 8-GPU host"


def test_compose_demo_sims_play_the_roles_on_the_same_names(pd_compose: Obj) -> None:
    import argparse

    from pools.sim.cli import add_arguments

    cfg = load_config(COMPOSE / "pools.pd.yaml", env={})
    (pool,) = cfg.pools
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    services = pd_compose["services"]
    for role in ("prefill", "decode"):
        svc = services[f"sim-extended-{role}"]
        args = parser.parse_args(svc["command"][1:])
        assert args.role == role and args.max_model_len == pool.max_model_len
        (alias,) = svc["networks"]["default"]["aliases"]
        assert f"http://{alias}:{args.port}" in getattr(pool.disaggregation, role).endpoints
    assert services["sim-extended-prefill"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "pool-extended-prefill-0"
    for gw in ("pd-gateway-1", "pd-gateway-2"):
        svc = services[gw]
        assert "./pools.pd.yaml:/etc/m3gate/pools.yaml:ro" in svc["volumes"]
        assert set(svc["profiles"]) == {"gpu-pd", "demo-pd"}
    base = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    # compose.yaml's own gateways are off in these profiles; ours answer the load balancer under their names
    assert not {"gpu-pd", "demo-pd"} & set(base["gateway-1"]["profiles"])
    assert sorted(a for g in ("pd-gateway-1", "pd-gateway-2")
                  for a in services[g]["networks"]["default"]["aliases"]) == ["gateway-1", "gateway-2"]
    assert {"redis", "lb", "prometheus"} <= set(base)


def _compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


def merged(base: Obj, override: Obj) -> Obj:
    """`docker compose -f base -f override`'s merge: mappings merge key by key, other values the override replaces.
    (Compose merges a few lists, ports or volumes, by key; the example's override only adds services.)"""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("profile", ["gpu-pd", "demo-pd"])
def test_the_merged_stack_validates_and_resolves_its_references(pd_compose: Obj, profile: str) -> None:
    """What `docker compose -f compose.yaml -f compose.pd.yaml --profile P config` checks, offline: the merged file
    against the compose-spec schema, and every dependency, network and volume of the profile's services defined. Where
    the compose plugin is installed, the same command runs too."""
    base = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    stack = merged(base, pd_compose)
    assert set(stack["services"]) == set(base["services"]) | set(pd_compose["services"])
    schema = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(stack))
    assert not errors, [e.message for e in errors]
    started = {n: s for n, s in stack["services"].items() if not s.get("profiles") or profile in s["profiles"]}
    assert {"pd-gateway-1", "pd-gateway-2", "redis", "lb"} <= set(started)
    networks, volumes = {"default", *(stack.get("networks") or {})}, set(stack.get("volumes") or {})
    for name, svc in started.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in started, f"{name} depends on {dep}, which --profile {profile} does not start"
        for net in svc.get("networks") or {}:
            assert net in networks, f"{name} joins undefined network {net}"
        for mount in svc.get("volumes") or []:
            source = mount.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name} mounts missing {source}"
            elif not source.startswith(("$", "/")):
                assert source in volumes, f"{name} mounts undeclared volume {source}"
    if _compose_plugin():
        result = subprocess.run(["docker", "compose", "-f", "compose.yaml", "-f", "compose.pd.yaml", "--profile",
                                 profile, "config", "--quiet"], cwd=COMPOSE, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr


def test_the_merged_stack_check_can_fail(pd_compose: Obj) -> None:
    base = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    broken = merged(base, merged(pd_compose, {"services": {"pd-gateway-1": {"helthcheck": {}}}}))
    assert broken["services"]["pd-gateway-1"]["image"] == "m3gate:0.1.0"  # merged into, not replaced
    schema = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


# ---- kubernetes -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def overlay() -> list[Obj]:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["resources"][0] == "../base"
    docs: list[Obj] = []
    for resource in kustomization["resources"][1:]:
        docs += [d for d in yaml.safe_load_all((OVERLAY / resource).read_text()) if d]
    return docs


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    (match,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return match


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_overlay_objects_validate(overlay: list[Obj]) -> None:
    for obj in overlay:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_overlay_pool_file_keeps_the_base_pools_and_adds_extended() -> None:
    base = load_config(ROOT / "deploy" / "k8s" / "base" / "pools.yaml", env={})
    cfg = load_config(OVERLAY / "pools.yaml", env={})
    assert [p.name for p in cfg.pools] == [*(p.name for p in base.pools), "extended"]
    assert cfg.pools[:-1] == base.pools


def test_overlay_roles_run_the_rendered_commands_behind_their_services(overlay: list[Obj]) -> None:
    cfg = load_config(OVERLAY / "pools.yaml", env={})
    pool = cfg.pools[-1]
    assert pool.disaggregation is not None
    commands = render(pool, cfg.model)
    for role in ("prefill", "decode"):
        cmds = [c for c in commands if c.role == role]
        name = f"vllm-extended-{role}"
        dep, svc = find(overlay, "Deployment", name), find(overlay, "Service", name)
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert c["command"] + c["args"] == cmds[0].argv, f"{name}: re-paste `m3gate pools render`"
        assert dep["spec"]["replicas"] == len(cmds) and c["image"] == cmds[0].image
        env = {e["name"]: e for e in c["env"]}
        assert {k: env[k].get("value") for k in cmds[0].env} == cmds[0].env
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == cmds[0].port and ports["nixl"] == int(cmds[0].env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert c["resources"]["limits"][cmds[0].gpu_resource] == cmds[0].gpus
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(dep["spec"]["selector"]["matchLabels"], labels) and selects(svc["spec"]["selector"], labels)
        assert svc["spec"]["clusterIP"] == "None"
        discovery = getattr(pool.disaggregation, role).discovery
        assert discovery is not None and discovery.dns_name.split(".")[0] == name
        assert next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http") == discovery.port
    other = find(overlay, "Deployment", "vllm-extended-decode")["spec"]["template"]["metadata"]["labels"]
    assert not selects(find(overlay, "Service", "vllm-extended-prefill")["spec"]["selector"], other)


def test_only_decode_pods_reach_the_prefill_side_channel(overlay: list[Obj]) -> None:
    policy = find(overlay, "NetworkPolicy", "vllm-extended-nixl")
    prefill = find(overlay, "Deployment", "vllm-extended-prefill")["spec"]["template"]["metadata"]["labels"]
    decode = find(overlay, "Deployment", "vllm-extended-decode")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], prefill)
    assert not selects(policy["spec"]["podSelector"]["matchLabels"], decode)
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["nixl"]
    (source,) = rule["from"]
    assert selects(source["podSelector"]["matchLabels"], decode)


def test_kustomize_builds_the_overlay(tmp_path: Path) -> None:
    docs = kustomized(OVERLAY)  # kubectl's built-in kustomize, or the offline builder where kubectl is not installed
    for obj in docs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (tmp_path / "pools.yaml").write_text(cm["data"]["pools.yaml"])
    assert load_config(tmp_path / "pools.yaml", env={}).pools[-1].name == "extended"
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert {"m3gate", "vllm-short", "vllm-extended-prefill", "vllm-extended-decode"} <= names
