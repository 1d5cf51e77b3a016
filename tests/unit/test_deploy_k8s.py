"""deploy/k8s, offline: every object against the Kubernetes schemas that `kubernetes-validate` ships, and the
cross-references a typo would break (selectors, Services, the pool file, the rendered vLLM args, DNS names)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from policies.config import GatewayConfig, load_config
from policies.launch import render
from tests.support.kustomize import build, kustomized

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
K8S_VERSION = "1.32.0"
GATEWAY_PORT_NAME = "http"

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def kustomization() -> Obj:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization: Obj) -> list[Obj]:
    docs: list[Obj] = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / resource).read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def pool_file(kustomization: Obj) -> GatewayConfig:
    (generator,) = kustomization["configMapGenerator"]
    (source,) = generator["files"]
    return load_config(BASE / source, env={})


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_labels(objects: list[Obj]) -> list[dict[str, str]]:
    return [o["spec"]["template"]["metadata"]["labels"] for o in objects if o["kind"] == "Deployment"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container(deployment: Obj) -> Obj:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def probe_path(c: Obj, probe: str) -> str:
    return c[probe]["httpGet"]["path"]


def test_every_object_validates_against_the_kubernetes_schemas(objects: list[Obj]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret"} <= kinds


def test_the_schema_check_can_fail(objects: list[Obj]) -> None:
    broken = copy.deepcopy(find(objects, "Deployment", "m3gate"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_every_service_selects_some_pod_template(objects: list[Obj]) -> None:
    templates = pod_labels(objects)
    for svc in (o for o in objects if o["kind"] == "Service"):
        assert any(selects(svc["spec"]["selector"], labels) for labels in templates), svc["metadata"]["name"]


def test_every_deployment_selector_matches_its_template(objects: list[Obj]) -> None:
    for dep in (o for o in objects if o["kind"] == "Deployment"):
        assert selects(dep["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])


def test_gateway_deployment_probes_config_and_keys(objects: list[Obj], kustomization: Obj) -> None:
    gw = find(objects, "Deployment", "m3gate")
    assert gw["spec"]["replicas"] == 2
    c = container(gw)
    assert probe_path(c, "readinessProbe") == "/ready"
    assert probe_path(c, "livenessProbe") == "/health"
    assert c["args"] == ["serve", "--config", "/etc/m3gate/pools.yaml"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/m3gate")
    volume = next(v for v in gw["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    (generator,) = kustomization["configMapGenerator"]
    assert volume["configMap"]["name"] == generator["name"]
    assert generator["files"] == ["pools.yaml"]  # mounted at /etc/m3gate/pools.yaml
    env = {e["name"]: e for e in c["env"]}
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == GATEWAY_PORT_NAME)
    assert env["M3GATE_PORT"]["value"] == str(port)
    redis_host = env["M3GATE_STATE"]["value"].split("//")[1].split(":")[0]
    find(objects, "Service", redis_host)
    secret = find(objects, "Secret", "m3gate-keys")
    for e in c["env"] + [e for d in objects if d["kind"] == "Deployment" for e in container(d).get("env", [])]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == "m3gate-keys" and ref["key"] in secret["stringData"]
    assert c["resources"]["requests"]["cpu"], "the HPA scales on CPU utilisation: it needs a CPU request"


def test_gateway_service_hpa_and_pdb_point_at_the_gateway(objects: list[Obj]) -> None:
    gw = find(objects, "Deployment", "m3gate")
    labels = gw["spec"]["template"]["metadata"]["labels"]
    svc = find(objects, "Service", "m3gate")
    assert selects(svc["spec"]["selector"], labels)
    assert svc["spec"]["ports"][0]["targetPort"] == GATEWAY_PORT_NAME
    hpa = find(objects, "HorizontalPodAutoscaler", "m3gate")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "m3gate")
    assert hpa["spec"]["minReplicas"] >= gw["spec"]["replicas"] >= 2
    pdb = find(objects, "PodDisruptionBudget", "m3gate")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"], "a drain must be able to evict one gateway"


def test_pool_file_finds_each_pool_through_its_headless_service(
    objects: list[Obj], pool_file: GatewayConfig, kustomization: Obj
) -> None:
    namespace = kustomization["namespace"]
    for pool in pool_file.pools:
        assert pool.discovery is not None and not pool.endpoints
        svc_name, ns, *rest = pool.discovery.dns_name.split(".")
        assert ns == namespace and rest == ["svc", "cluster", "local"]
        svc = find(objects, "Service", svc_name)
        assert svc["spec"]["clusterIP"] == "None"
        http = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
        assert http["port"] == pool.discovery.port
        dep = find(objects, "Deployment", svc_name)
        assert selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
        assert not selects(svc["spec"]["selector"], find(objects, "Deployment", "m3gate")["spec"]["template"]["metadata"]["labels"])


def test_pool_deployments_run_exactly_the_rendered_commands(objects: list[Obj], pool_file: GatewayConfig) -> None:
    pool_deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"
                        and o["metadata"]["name"].startswith("vllm-")}
    assert pool_deployments == {f"vllm-{p.name}" for p in pool_file.pools}
    for pool in pool_file.pools:
        assert pool.launch is not None
        cmds = render(pool, pool_file.model)
        dep = find(objects, "Deployment", f"vllm-{pool.name}")
        c = container(dep)
        assert dep["spec"]["replicas"] == len(cmds) == pool.launch.replicas
        assert c["command"] + c["args"] == cmds[0].argv, f"vllm-{pool.name}: re-paste `m3gate pools render`"
        assert c["image"] == cmds[0].image
        env = {e["name"]: e for e in c.get("env", [])}
        assert {k: env[k].get("value") for k in cmds[0].env} == cmds[0].env
        assert set(env) - set(cmds[0].env) <= {"VLLM_API_KEY", "HF_TOKEN"}
        resources = c["resources"]
        assert resources["limits"][cmds[0].gpu_resource] == resources["requests"][cmds[0].gpu_resource] == cmds[0].gpus
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == cmds[0].port
        if cmds[0].kv_events_ports:
            assert ports["kv-events"] == cmds[0].kv_events_ports[0]
            svc_ports = {p["name"] for p in find(objects, "Service", f"vllm-{pool.name}")["spec"]["ports"]}
            assert {"kv-events", "kv-replay"} <= svc_ports


def test_pool_pods_have_health_probes_shared_memory_and_the_model_cache(objects: list[Obj]) -> None:
    for dep in (o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("vllm-")):
        c = container(dep)
        assert probe_path(c, "readinessProbe") == "/health"
        assert probe_path(c, "startupProbe") == "/health"
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        claim = volumes[mounts["/root/.cache/huggingface"]]["persistentVolumeClaim"]["claimName"]
        find(objects, "PersistentVolumeClaim", claim)


def test_kv_event_ports_are_open_to_gateways_only(objects: list[Obj]) -> None:
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pool_pods = [o["spec"]["template"]["metadata"]["labels"] for o in objects if o["kind"] == "Deployment"
                 and o["metadata"]["name"].startswith("vllm-")]
    assert all(selects(policy["spec"]["podSelector"]["matchLabels"], labels) for labels in pool_pods)
    gateway_labels = find(objects, "Deployment", "m3gate")["spec"]["template"]["metadata"]["labels"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports & {"kv-events", "kv-replay"}:
            (source,) = rule["from"]
            assert selects(source["podSelector"]["matchLabels"], gateway_labels)
            assert "namespaceSelector" not in source


def test_kustomize_build_validates_and_wires_the_generated_configmap(tmp_path: Path) -> None:
    docs = kustomized(BASE)  # kubectl's built-in kustomize, or the offline builder where kubectl is not installed
    for obj in docs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "m3gate"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    gw = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "m3gate")
    assert cm["metadata"]["name"].startswith("m3gate-pools-")  # hashed: a new pool file rolls the gateways
    assert any(v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in gw["spec"]["template"]["spec"]["volumes"])
    (tmp_path / "pools.yaml").write_text(cm["data"]["pools.yaml"])
    load_config(tmp_path / "pools.yaml", env={})


def test_the_offline_kustomize_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n  - path: p.yaml\n")
    with pytest.raises(NotImplementedError, match="patches"):
        build(tmp_path)
