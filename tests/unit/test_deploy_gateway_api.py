"""deploy/k8s/gateway-api, offline: the overlay builds; core objects validate against `kubernetes-validate`'s schemas
and the custom resources (InferencePool, InferenceObjective, Gateway, HTTPRoute) against the vendored schemas in
tests/schemas/gateway-api; the references a typo would break hold (the pool's selector and port, the picker's
Service, command line and probes, the route's backend) and the objectives mirror the pool file's traffic classes."""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from policies.config import BATCH_CLASS, GatewayConfig, load_config
from tests.support.kustomize import kustomized

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "gateway-api"
SCHEMAS = ROOT / "tests" / "schemas" / "gateway-api"
K8S_VERSION = "1.32.0"
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.v1.json",
    ("llm-d.ai/v1alpha2", "InferenceObjective"): "inferenceobjective.v1alpha2.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.v1.json",
}
# The picker's command line, as fixed for `m3gate epp` (issue #27).
EPP_SYNOPSIS = ("m3gate epp --config pools.yaml [--host 0.0.0.0] [--port 9002] [--http-port 9003] "
                "[--response-processing full|none]")
POOL_PATH = "/etc/m3gate/pools.yaml"

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    return kustomized(OVERLAY)  # kubectl's built-in kustomize, or the offline builder where kubectl is not installed


@pytest.fixture(scope="module")
def pool_file(objects: list[Obj], tmp_path_factory: pytest.TempPathFactory) -> GatewayConfig:
    """The pool file the picker mounts: the data of the ConfigMap its config volume names."""
    volume = next(v for v in pod_spec(find(objects, "Deployment", "m3gate-epp"))["volumes"] if v["name"] == "config")
    cm = find(objects, "ConfigMap", volume["configMap"]["name"])
    path = tmp_path_factory.mktemp("epp") / "pools.yaml"
    path.write_text(cm["data"]["pools.yaml"])
    return load_config(path, env={})


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_spec(deployment: Obj) -> Obj:
    return deployment["spec"]["template"]["spec"]


def container(deployment: Obj) -> Obj:
    (c,) = pod_spec(deployment)["containers"]
    return c


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def crd_errors(obj: Obj) -> list[str]:
    """Schema errors of a custom resource, plus the CRDs' CEL rules that apply to these manifests."""
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]).read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    spec = obj.get("spec") or {}
    if obj["kind"] == "InferencePool":
        ref = spec.get("endpointPickerRef") or {}
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            errors.append("endpointPickerRef: port is required when kind is 'Service'")
    if obj["kind"] == "HTTPRoute":
        for rule in spec.get("rules") or []:
            for ref in rule.get("backendRefs") or []:
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and "port" not in ref:
                    errors.append(f"backendRefs {ref['name']}: a Service backend needs a port")
            t = rule.get("timeouts") or {}
            if "request" in t and "backendRequest" in t and seconds(t["backendRequest"]) > seconds(t["request"]):
                errors.append("timeouts: backendRequest must be <= request")
    return errors


def seconds(duration: str) -> float:
    """A Gateway API Duration (GEP-2257: `1h30m`, `3600s`, `500ms`) in seconds."""
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(int(n) * unit[u] for n, u in re.findall(r"([0-9]+)(ms|h|m|s)", duration))


def epp_parser() -> argparse.ArgumentParser:
    """A parser for EPP_SYNOPSIS: the picker's args must parse with it and nothing else."""
    parser = argparse.ArgumentParser(prog="m3gate epp", exit_on_error=False)
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument("--http-port", type=int, default=9003)
    parser.add_argument("--response-processing", choices=["full", "none"])
    return parser


def expected_objectives(cfg: GatewayConfig) -> dict[str, int]:
    """Class → InferenceObjective priority: m3gate serves lower priorities first, InferenceObjective higher ones, so
    the order flips and the least urgent class lands on 0."""
    classes = {name: c for name, c in cfg.traffic.classes.items() if name != BATCH_CLASS}  # runs in-process only
    top = max(c.priority for c in classes.values())
    return {name: top - c.priority for name, c in classes.items()}


def test_every_object_validates(objects: list[Obj]) -> None:
    custom = 0
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
            assert not crd_errors(obj), (obj["kind"], obj["metadata"]["name"], crd_errors(obj))
            custom += 1
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "m3gate"
    kinds = {o["kind"] for o in objects}
    assert {"InferencePool", "InferenceObjective", "Gateway", "HTTPRoute", "Deployment", "Service"} <= kinds
    assert custom >= 4


@pytest.mark.parametrize(("kind", "name", "mutate", "error"), [
    ("InferencePool", "minimax-m3", lambda o: o["spec"]["endpointPickerRef"].update(failureMode="Closed"), "Closed"),
    ("InferencePool", "minimax-m3", lambda o: o["spec"]["endpointPickerRef"].pop("port"), "port is required"),
    ("InferencePool", "minimax-m3", lambda o: o["spec"]["endpointPickerRef"].update(portNumber=9002), "portNumber"),
    ("InferencePool", "minimax-m3", lambda o: o["spec"]["targetPorts"].append({"number": 8001}), "too long"),
    ("InferenceObjective", "interactive", lambda o: o["spec"].update(priority="high"), "not of type"),
    ("InferenceObjective", "interactive", lambda o: o["spec"].pop("poolRef"), "poolRef"),
    ("Gateway", "m3gate", lambda o: o["spec"]["listeners"][0].update(port=0), "minimum"),
    ("HTTPRoute", "minimax-m3", lambda o: o["spec"]["rules"][0]["timeouts"].update(request="1 hour"), "match"),
    ("HTTPRoute", "minimax-m3", lambda o: o["spec"]["rules"][0]["timeouts"].update(backendRequest="2h"), "<="),
    ("HTTPRoute", "minimax-m3", lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(kind="Service", group=""),
     "needs a port"),
])
def test_the_custom_resource_checks_can_fail(objects: list[Obj], kind: str, name: str, mutate: Any,
                                             error: str) -> None:
    broken = copy.deepcopy(find(objects, kind, name))
    mutate(broken)
    assert any(error in e for e in crd_errors(broken)), crd_errors(broken)


def test_the_pool_selects_every_model_server_pod_and_nothing_else(objects: list[Obj], pool_file: GatewayConfig) -> None:
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    selector = pool["spec"]["selector"]["matchLabels"]
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    servers = [d for d in deployments if d["metadata"]["name"].startswith("vllm-")]
    assert {d["metadata"]["name"] for d in servers} == {f"vllm-{p.name}" for p in pool_file.pools}
    for dep in deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(selector, labels) == (dep in servers), dep["metadata"]["name"]
    (target,) = pool["spec"]["targetPorts"]
    for p in pool_file.pools:  # the picker's DNS discovery and the gateway reach the same port
        assert p.discovery is not None and p.discovery.port == target["number"]
        ports = {cp["name"]: cp["containerPort"] for cp in container(find(objects, "Deployment", f"vllm-{p.name}"))["ports"]}
        assert ports["http"] == target["number"]


def test_the_endpoint_picker_ref_names_the_picker_service_and_port(objects: list[Obj]) -> None:
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    assert ref["failureMode"] == "FailClose"
    svc = find(objects, "Service", ref["name"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "http2"  # gRPC: the gateway must speak HTTP/2 to it
    epp = find(objects, "Deployment", "m3gate-epp")
    assert selects(svc["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    assert not selects(svc["spec"]["selector"], find(objects, "Deployment", "m3gate")["spec"]["template"]["metadata"]["labels"])
    target = next(cp for cp in container(epp)["ports"] if cp["name"] == port["targetPort"])
    args = epp_parser().parse_args(container(epp)["args"][1:])
    assert target["containerPort"] == args.port == 9002


def test_the_picker_runs_the_fixed_command_line(objects: list[Obj], pool_file: GatewayConfig) -> None:
    epp = find(objects, "Deployment", "m3gate-epp")
    c = container(epp)
    assert c["image"] == container(find(objects, "Deployment", "m3gate"))["image"]
    assert c["args"][0] == "epp"
    synopsis = [a for a in shlex.split(EPP_SYNOPSIS.replace("[", " ").replace("]", " ")) if a.startswith("--")]
    assert {a for a in c["args"] if a.startswith("--")} <= set(synopsis), "a flag the fixed command line lacks"
    args = epp_parser().parse_args(c["args"][1:])
    assert args.config == POOL_PATH and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["http"]) == (args.port, args.http_port)
    assert c["readinessProbe"]["grpc"] == {"port": args.port, "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": args.port, "service": "liveness"}
    assert epp["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(args.http_port)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(Path(POOL_PATH).parent))
    volume = next(v for v in pod_spec(epp)["volumes"] if v["name"] == mount["name"])
    gateway_volume = next(v for v in pod_spec(find(objects, "Deployment", "m3gate"))["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == gateway_volume["configMap"]["name"], "one pool file, two front doors"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert pod_spec(epp)["terminationGracePeriodSeconds"] > pool_file.server.upstream_read_timeout_s
    svc_ports = {p["name"]: p for p in find(objects, "Service", "m3gate-epp")["spec"]["ports"]}
    assert svc_ports["http"]["port"] == args.http_port and svc_ports["grpc"]["port"] == args.port


def test_the_picker_parser_refuses_what_the_command_line_does_not_have() -> None:
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        epp_parser().parse_args(["--config", POOL_PATH, "--response-processing", "headers"])
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        epp_parser().parse_args(["--port", "9002"])


def test_the_route_sends_the_api_to_the_pool_with_stream_length_timeouts(objects: list[Obj],
                                                                         pool_file: GatewayConfig) -> None:
    (gateway,) = [o for o in objects if o["kind"] == "Gateway"]
    (route,) = [o for o in objects if o["kind"] == "HTTPRoute"]
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gateway["metadata"]["name"])
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]  # /v1/*, /tokenize, errors: all of it
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    for key in ("request", "backendRequest"):
        assert seconds(rule["timeouts"][key]) >= 3600 > pool_file.server.upstream_read_timeout_s


def test_objectives_mirror_the_pool_files_traffic_classes(objects: list[Obj], pool_file: GatewayConfig) -> None:
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    objectives = [o for o in objects if o["kind"] == "InferenceObjective"]
    got = {o["metadata"]["name"]: o["spec"]["priority"] for o in objectives}
    assert got == expected_objectives(pool_file), "objectives.yaml has drifted from the pool file's traffic classes"
    for o in objectives:
        ref = o["spec"]["poolRef"]
        assert (ref["group"], ref["kind"], ref["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                            pool["metadata"]["name"])
    served_first = min(pool_file.traffic.classes, key=lambda n: pool_file.traffic.classes[n].priority)
    assert max(got, key=got.__getitem__) == served_first
    classes = {n: c.model_copy(update={"priority": -c.priority}) for n, c in pool_file.traffic.classes.items()}
    drifted = pool_file.model_copy(update={"traffic": pool_file.traffic.model_copy(update={"classes": classes})})
    assert expected_objectives(drifted) != got  # the comparison notices changed classes


def test_kv_event_ports_are_open_to_the_picker(objects: list[Obj]) -> None:
    policy = find(objects, "NetworkPolicy", "vllm-pools-epp")
    epp_labels = find(objects, "Deployment", "m3gate-epp")["spec"]["template"]["metadata"]["labels"]
    for dep in (o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("vllm-")):
        assert selects(policy["spec"]["podSelector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
    (rule,) = policy["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {"kv-events", "kv-replay"}
    (source,) = rule["from"]
    assert selects(source["podSelector"]["matchLabels"], epp_labels) and "namespaceSelector" not in source
