"""deploy/k8s/autoscaling-hpa and autoscaling-keda, offline: one HPA and one KEDA ScaledObject per pool role of the
pool file, each on the Deployment whose Service the pool file discovers that role through, following
m3gate_pool_desired_replicas{pool,role} at AverageValue 1 within the pool's capacity bounds. HPAs validate against
the Kubernetes schemas; KEDA's HPA behaviour is validated the same way inside an HPA (its CRD schema is not here)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from policies.config import GatewayConfig, load_config
from tests.support.kustomize import kustomized

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32.0"
METRIC = "m3gate_pool_desired_replicas"
Obj = dict[str, Any]


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _resources(folder: Path) -> list[Obj]:
    """Every object a kustomization lists, following `../overlay` folders."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out: list[Obj] = []
    for resource in kustomization["resources"]:
        path = (folder / resource).resolve()
        out += _resources(path) if path.is_dir() else _docs(path)
    return out


@pytest.fixture(scope="module")
def pool_file() -> GatewayConfig:
    return load_config(K8S / "disaggregated" / "pools.yaml", env={})


def _roles(config: GatewayConfig) -> list[tuple[str, str, str, Any]]:
    """(pool, role, DNS name the gateway discovers it by, the pool's capacity bounds) for every pool role."""
    out = []
    for pool in config.pools:
        d = pool.disaggregation
        if d is None:
            assert pool.discovery is not None
            out.append((pool.name, "both", pool.discovery.dns_name, pool.capacity))
        else:
            for role, side in (("prefill", d.prefill), ("decode", d.decode)):
                assert side.discovery is not None
                out.append((pool.name, role, side.discovery.dns_name, pool.capacity))
    return out


def _deployment_behind(objects: list[Obj], dns_name: str) -> str:
    """The Deployment whose pods the headless Service named by `dns_name` selects."""
    service = dns_name.split(".")[0]
    (svc,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service]
    selector = svc["spec"]["selector"]
    (dep,) = [o for o in objects if o["kind"] == "Deployment" and all(
        o["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    return str(dep["metadata"]["name"])


@pytest.mark.parametrize("overlay, kind", [("autoscaling-hpa", "HorizontalPodAutoscaler"),
                                           ("autoscaling-keda", "ScaledObject")])
def test_each_pool_role_has_one_autoscaler_on_its_deployment(overlay: str, kind: str,
                                                             pool_file: GatewayConfig) -> None:
    objects = _resources(K8S / overlay)
    scalers = [o for o in objects if o["kind"] == kind and "m3gate.io/pool" in o["metadata"]["labels"]]  # not the
    # gateways' own CPU HPA
    roles = _roles(pool_file)
    assert len(scalers) == len(roles) == 5
    for pool, role, dns_name, bounds in roles:
        (scaler,) = [s for s in scalers if s["metadata"]["labels"]["m3gate.io/pool"] == pool
                     and s["metadata"]["labels"]["m3gate.io/role"] == role]
        spec = scaler["spec"]
        assert spec["scaleTargetRef"]["name"] == _deployment_behind(objects, dns_name)
        if kind == "HorizontalPodAutoscaler":
            assert (spec["minReplicas"], spec["maxReplicas"]) == (bounds.min_replicas, bounds.max_replicas)
            (metric,) = spec["metrics"]
            assert metric["type"] == "External"
            assert metric["external"]["metric"]["name"] == METRIC
            assert metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool, "role": role}
            assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        else:
            assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (bounds.min_replicas, bounds.max_replicas)
            (trigger,) = spec["triggers"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            assert trigger["metadata"]["threshold"] == "1"
            query = re.fullmatch(r"max\(" + METRIC + r"\{pool=\"([^\"]+)\",role=\"([^\"]+)\"\}\)",
                                 trigger["metadata"]["query"])
            assert query is not None and query.groups() == (pool, role)


def test_hpa_overlay_validates_against_the_kubernetes_schemas() -> None:
    objects = _docs(K8S / "autoscaling-hpa" / "hpa.yaml")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (adapter,) = [o for o in objects if o["kind"] == "ConfigMap"]
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    assert METRIC in rule["seriesQuery"] and rule["name"]["as"] == METRIC
    # the gateways publish the same count from their shared demand: one of them, not their sum
    assert rule["metricsQuery"].startswith("max(") and "by (pool, role)" in rule["metricsQuery"]


def test_the_schema_check_can_fail() -> None:
    hpa = copy.deepcopy(_docs(K8S / "autoscaling-hpa" / "hpa.yaml")[0])
    hpa["spec"]["metrics"][0]["external"]["target"]["averageValu"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def test_keda_behaviour_is_a_valid_hpa_behaviour() -> None:
    template = _docs(K8S / "autoscaling-hpa" / "hpa.yaml")[0]
    for scaled in _docs(K8S / "autoscaling-keda" / "scaledobjects.yaml"):
        assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
        hpa = copy.deepcopy(template)
        hpa["spec"]["behavior"] = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
        assert scaled["spec"]["cooldownPeriod"] >= 60


@pytest.mark.parametrize("overlay", ["autoscaling-hpa", "autoscaling-keda"])
def test_kustomize_builds_the_overlays(overlay: str) -> None:
    docs = kustomized(K8S / overlay)  # kubectl's built-in kustomize, or the offline builder where kubectl is missing
    assert all(d["metadata"].get("namespace") == "m3gate" for d in docs if d["kind"] != "Namespace")
    kinds = [d["kind"] for d in docs]
    assert kinds.count("ScaledObject" if overlay.endswith("keda") else "HorizontalPodAutoscaler") >= 5
