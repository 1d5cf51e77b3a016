"""deploy/k8s, every kustomization rendered offline: each vLLM pod can be restarted without failing a request. Its
preStop sleep outlasts the time the gateways need to stop sending it new requests (the pod leaves the headless
Service's DNS answer: endpoint propagation, CoreDNS' TTL, then the pool's next `discovery.refresh_s` lookup), then
SIGTERM lets its streams in flight run for `--shutdown-timeout` seconds, and the grace period covers both plus the
engine's teardown, so the kubelet's SIGKILL never cuts a stream the shutdown timeout allowed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.config import GatewayConfig, load_config
from tests.support.kustomize import build

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUSTOMIZATIONS = sorted(p.parent.name for p in K8S.glob("*/kustomization.yaml"))
COREDNS_TTL_S = 5  # the kubernetes plugin's default TTL: a removed pod may be answered this long after removal
PROPAGATION_S = 2  # EndpointSlice update reaching CoreDNS after the pod is marked terminating
TEARDOWN_S = 10  # engine teardown after the shutdown timeout (~8 s observed on a CPU vLLM 0.32 server)

Obj = dict[str, Any]


def pool_file(objects: list[Obj], tmp_path: Path) -> GatewayConfig:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("m3gate-pools")]
    path = tmp_path / "pools.yaml"
    path.write_text(cm["data"]["pools.yaml"])
    return load_config(path, env={})


def refresh_s(config: GatewayConfig, pool_name: str, role: str | None) -> float:
    """How often the gateways look the replicas of this pod's pool (and role) up."""
    pool = next(p for p in config.pools if p.name == pool_name)
    discovery = pool.discovery if role is None else getattr(pool.disaggregation, role).discovery
    assert discovery is not None, f"{pool_name}/{role}: the gateway finds these pods by DNS"
    return discovery.refresh_s


def vllm_templates(objects: list[Obj]) -> list[tuple[str, Obj, Obj]]:
    """(name, pod template, its vLLM container) of every workload running `vllm serve`."""
    out = []
    for obj in objects:
        template = (obj.get("spec") or {}).get("template")
        if not isinstance(template, dict):
            continue
        for c in template["spec"]["containers"]:
            if c.get("command", [])[:2] == ["vllm", "serve"]:
                out.append((obj["metadata"]["name"], template, c))
    return out


def violations(objects: list[Obj], config: GatewayConfig) -> list[str]:
    """What would fail a request when the pod is deleted (a rolling restart, a node drain)."""
    found = []
    for name, template, c in vllm_templates(objects):
        args = c["args"]
        if "--shutdown-timeout" not in args:
            found.append(f"{name}: no --shutdown-timeout, SIGTERM aborts its streams")
            continue
        shutdown = int(args[args.index("--shutdown-timeout") + 1])
        command = ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", [])
        if command[:1] != ["sleep"]:
            found.append(f"{name}: no preStop sleep, SIGTERM comes while gateways still send it requests")
            continue
        sleep = int(command[1])
        labels = template["metadata"]["labels"]
        role = labels.get("m3gate.io/role")
        stale = PROPAGATION_S + COREDNS_TTL_S + refresh_s(config, labels["m3gate.io/pool"], role)
        if sleep < stale:
            found.append(f"{name}: preStop {sleep} s < {stale} s for the gateways to stop sending it requests")
        grace = template["spec"].get("terminationGracePeriodSeconds", 30)
        if grace < sleep + shutdown + TEARDOWN_S:
            found.append(f"{name}: terminationGracePeriodSeconds {grace} < preStop {sleep} + --shutdown-timeout "
                         f"{shutdown} + teardown {TEARDOWN_S}")
    return found


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_vllm_pod_drains_within_its_grace_period(kustomization: str, tmp_path: Path) -> None:
    objects = build(K8S / kustomization)
    templates = vllm_templates(objects)
    assert len(templates) >= 3, f"{kustomization}: the vLLM pools should be there"
    assert violations(objects, pool_file(objects, tmp_path)) == []


def test_the_disaggregated_overlay_drains_both_roles(tmp_path: Path) -> None:
    names = {name for name, _, _ in vllm_templates(build(K8S / "disaggregated"))}
    assert {"vllm-extended-prefill", "vllm-extended-decode"} <= names


@pytest.mark.parametrize("breakage", ["short_grace", "short_sleep", "no_prestop", "no_timeout"])
def test_the_check_can_fail(breakage: str, tmp_path: Path) -> None:
    objects = copy.deepcopy(build(K8S / "base"))
    config = pool_file(objects, tmp_path)
    _, template, c = vllm_templates(objects)[0]
    if breakage == "short_grace":
        template["spec"]["terminationGracePeriodSeconds"] = 70  # 15 + 60 would leave no teardown time
    elif breakage == "short_sleep":
        c["lifecycle"]["preStop"]["exec"]["command"] = ["sleep", "5"]
    elif breakage == "no_prestop":
        del c["lifecycle"]
    else:
        i = c["args"].index("--shutdown-timeout")
        del c["args"][i:i + 2]
    (problem,) = violations(objects, config)
    assert problem.startswith(template["metadata"]["labels"]["m3gate.io/pool"].join(["vllm-", ":"]))


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.pd.yaml"])
def test_compose_waits_for_the_shutdown_timeout_before_killing_a_replica(compose: str) -> None:
    services = yaml.safe_load((K8S.parent / "compose" / compose).read_text())["services"]
    replicas = {name: s for name, s in services.items() if s.get("entrypoint") == ["vllm", "serve"]}
    assert len(replicas) >= 2
    for name, service in replicas.items():
        args = service["command"]
        shutdown = int(args[args.index("--shutdown-timeout") + 1])
        grace = service.get("stop_grace_period", "10s")  # docker's default
        assert grace.endswith("s") and int(grace[:-1]) >= shutdown + TEARDOWN_S, name
