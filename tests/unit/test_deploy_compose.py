"""deploy/compose, offline: the compose file against the compose-spec schema, and every cross-reference between
it, the pool files, HAProxy, Prometheus, the collector, Grafana and the Dockerfile."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from policies.config import GatewayConfig, load_config
from policies.launch import render

from tests.support.tools import require_tools

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
GPU_PROFILES = ("gpu", "gpu-max")
PROFILES = (*GPU_PROFILES, "demo")
GPUS_ON_HOST = 8
GATEWAY_HOSTS = ("gateway-1", "gateway-2")
CONFIG_PATH = "/etc/m3gate/pools.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def real() -> GatewayConfig:
    return load_config(COMPOSE_DIR / "pools.yaml", env={})


@pytest.fixture(scope="module")
def demo() -> GatewayConfig:
    return load_config(COMPOSE_DIR / "pools.demo.yaml", env={})


def active(services: dict[str, dict[str, Any]], profile: str) -> dict[str, dict[str, Any]]:
    """Services `docker compose --profile PROFILE up` starts."""
    return {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}


def hostnames(name: str, service: dict[str, Any]) -> set[str]:
    """Names a service answers to on the default network: its own and its aliases."""
    nets = service.get("networks") or {}
    aliases = set((nets.get("default") or {}).get("aliases", [])) if isinstance(nets, dict) else set()
    return {name, *aliases}


def hosts_in(services: dict[str, dict[str, Any]], profile: str) -> dict[str, str]:
    """host name -> service, in one profile; a name two running services claim would be a DNS round-robin."""
    seen: dict[str, str] = {}
    for name, svc in active(services, profile).items():
        for host in hostnames(name, svc):
            assert host not in seen, f"{host} is claimed by {seen[host]} and {name} in profile {profile}"
            seen[host] = name
    return seen


def test_compose_file_matches_the_compose_spec_schema(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_can_fail(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["helthcheck"] = {}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_pool_files_parse(real: GatewayConfig, demo: GatewayConfig) -> None:
    assert all(p.launch is not None for p in real.pools)
    assert [(p.name, p.max_model_len, p.modalities) for p in demo.pools] == [
        (p.name, p.max_model_len, p.modalities) for p in real.pools
    ], "the demo must offer the same pools as the real stack"
    assert demo.model == real.model


def test_references_between_services_resolve(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    named_volumes = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown {dep}"
            dep_profiles = services[dep].get("profiles")
            assert not dep_profiles or set(svc.get("profiles") or PROFILES) <= set(dep_profiles), (
                f"{name} depends on {dep}, which is not started in all of {name}'s profiles"
            )
        for profile in svc.get("profiles") or []:
            assert profile in PROFILES, f"{name}: unknown profile {profile}"
        for mount in svc.get("volumes") or []:
            source = mount.split(":", 1)[0]
            if source.startswith("."):
                path = (COMPOSE_DIR / source).resolve()
                assert path.exists(), f"{name} mounts missing {source}"
            elif not source.startswith("$") and not source.startswith("/"):
                assert source in named_volumes, f"{name} mounts undeclared volume {source}"


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_gpu_reservations_fit_one_host_without_sharing_a_gpu(
    services: dict[str, dict[str, Any]], profile: str
) -> None:
    taken: dict[str, str] = {}
    for name, svc in active(services, profile).items():
        for device in svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []):
            assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
            for gpu in device["device_ids"]:
                assert 0 <= int(gpu) < GPUS_ON_HOST
                assert gpu not in taken, f"GPU {gpu} given to {taken[gpu]} and {name} in profile {profile}"
                taken[gpu] = name


def test_pool_services_run_exactly_the_rendered_commands(
    services: dict[str, dict[str, Any]], real: GatewayConfig
) -> None:
    expected = {f"pool-{c.name}": c for p in real.pools for c in render(p, real.model)}
    pool_services = {n: s for n, s in services.items() if n.startswith("pool-")}
    assert set(pool_services) == set(expected), "one compose service per pool replica of pools.yaml"
    for name, svc in pool_services.items():
        cmd = expected[name]
        assert svc["entrypoint"] + svc["command"] == cmd.argv, f"{name}: `m3gate pools render` changed; re-paste it"
        assert svc["image"] == cmd.image
        env = svc.get("environment") or {}
        assert {k: env.get(k) for k in cmd.env} == cmd.env, f"{name}: environment differs from the rendered one"
        assert set(env) - set(cmd.env) <= {"HF_TOKEN"}
        assert not any("$" in a for a in cmd.argv), "compose would interpolate a $ in the args"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(device["device_ids"]) == cmd.gpus
        assert set(svc["profiles"]) <= set(GPU_PROFILES)


def test_pool_endpoints_are_the_pool_services(services: dict[str, dict[str, Any]], real: GatewayConfig) -> None:
    for pool in real.pools:
        assert pool.launch is not None
        wanted = [f"http://pool-{c.name}:{c.port}" for c in render(pool, real.model)]
        assert pool.endpoints == wanted


def test_every_pool_runs_in_some_gpu_profile(services: dict[str, dict[str, Any]], real: GatewayConfig) -> None:
    for pool in real.pools:
        for endpoint in pool.endpoints:
            host = urlsplit(endpoint).hostname
            assert any(host in hosts_in(services, p) for p in GPU_PROFILES), f"nothing serves {endpoint}"


def test_demo_simulators_stand_in_for_every_pool(services: dict[str, dict[str, Any]], demo: GatewayConfig) -> None:
    from pools.sim.cli import add_arguments

    sim_parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(sim_parser)
    hosts = hosts_in(services, "demo")
    for pool in demo.pools:
        for endpoint in pool.endpoints:
            url = urlsplit(endpoint)
            assert url.hostname in hosts, f"demo: nothing answers {endpoint}"
            sim = services[hosts[url.hostname]]
            assert sim["profiles"] == ["demo"]
            argv = sim["command"]
            assert argv[0] == "sim"
            args = sim_parser.parse_args(argv[1:])  # the simulator's own CLI accepts the command
            assert args.port == url.port
            assert args.max_model_len == pool.max_model_len
            assert list(args.modalities) == list(pool.modalities)
            assert args.host == "0.0.0.0"  # reachable from the gateways' containers
    assert not any(n.startswith("pool-") for n in active(services, "demo")), "the demo needs no GPU"


@pytest.mark.parametrize("profile", PROFILES)
def test_two_gateways_per_profile_behind_the_load_balancer(
    services: dict[str, dict[str, Any]], profile: str
) -> None:
    hosts = hosts_in(services, profile)
    pool_file = "./pools.demo.yaml" if profile == "demo" else "./pools.yaml"
    for host in GATEWAY_HOSTS:
        gw = services[hosts[host]]
        assert gw["command"] == ["serve", "--config", CONFIG_PATH]
        assert f"{pool_file}:{CONFIG_PATH}:ro" in gw["volumes"]
        state = urlsplit(gw["environment"]["M3GATE_STATE"])
        assert state.scheme == "redis" and state.hostname in hosts and services[hosts[state.hostname]]["image"].startswith("redis")
        otel = urlsplit(gw["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert otel.hostname in hosts
    haproxy = (COMPOSE_DIR / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server\s+\S+\s+([\w.-]+):(\d+)", haproxy, re.MULTILINE)
    gateway_port = services[hosts["gateway-1"]]["environment"]["M3GATE_PORT"]
    assert sorted(servers) == sorted((h, gateway_port) for h in GATEWAY_HOSTS)
    (bind,) = re.findall(r"frontend m3gate\s+bind :(\d+)", haproxy)
    assert f"{bind}:{bind}" in services["lb"]["ports"]


@pytest.mark.parametrize("profile", PROFILES)
def test_gateway_port_agrees_with_its_pool_file(services: dict[str, dict[str, Any]], profile: str) -> None:
    hosts = hosts_in(services, profile)
    gw = services[hosts["gateway-1"]]
    source = gw["volumes"][0].split(":")[0]
    cfg = load_config(COMPOSE_DIR / source, env={})
    assert str(cfg.server.port) == gw["environment"]["M3GATE_PORT"]
    assert cfg.state == gw["environment"]["M3GATE_STATE"]


def test_prometheus_scrapes_the_gateways_and_discovers_every_pool_replica_from_them(
    services: dict[str, dict[str, Any]]
) -> None:
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    every_host = set().union(*(hosts_in(services, p) for p in PROFILES))
    gw = services[hosts_in(services, "demo")["gateway-1"]]
    gateway_targets = {f"{h}:{gw['environment']['M3GATE_PORT']}" for h in GATEWAY_HOSTS}
    # deploy/prometheus/rules alert on up{job="m3gate"} and up{job="vllm"}
    assert set(jobs["m3gate"]["static_configs"][0]["targets"]) == gateway_targets
    sd_urls = [urlsplit(sd["url"]) for sd in jobs["vllm"]["http_sd_configs"]]
    assert {u.netloc for u in sd_urls} == gateway_targets  # either gateway can list the replicas
    assert {u.path for u in sd_urls} == {"/metrics/targets"}
    for job in jobs.values():
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                assert target.split(":")[0] in every_host, f"scrape target {target} is no service"
    (rules_mount,) = [v for v in services["prometheus"]["volumes"] if v.startswith("../prometheus/rules:")]
    assert (COMPOSE_DIR / "../prometheus/rules").resolve().is_dir()
    assert any(rules_mount.split(":")[1] in pattern for pattern in prom["rule_files"])


def test_traces_flow_from_pools_and_gateways_through_the_collector_to_jaeger(
    services: dict[str, dict[str, Any]], real: GatewayConfig
) -> None:
    collector = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    grpc_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for pool in real.pools:
        assert pool.launch is not None and pool.launch.otlp_traces_endpoint is not None
        url = urlsplit(pool.launch.otlp_traces_endpoint)
        assert url.hostname == "otel-collector" and str(url.port) == grpc_port
    assert "otel-collector" in services
    (exporter,) = [v for k, v in collector["exporters"].items() if k.startswith("otlp")]
    assert exporter["endpoint"].split(":")[0] == "jaeger" and "jaeger" in services
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name, pipeline in collector["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline[kind]) <= set(collector[kind]), f"pipeline {name} uses undefined {kind}"


def test_grafana_provisioning_points_at_the_stack(services: dict[str, dict[str, Any]]) -> None:
    prov = COMPOSE_DIR / "grafana" / "provisioning"
    sources = yaml.safe_load((prov / "datasources" / "datasources.yaml").read_text())["datasources"]
    for source in sources:
        url = urlsplit(source["url"])
        assert url.hostname in services
    assert {s["type"] for s in sources} == {"prometheus", "jaeger"}
    (provider,) = yaml.safe_load((prov / "dashboards" / "dashboards.yaml").read_text())["providers"]
    dashboards_mount = next(v for v in services["grafana"]["volumes"] if v.startswith("../grafana:"))
    assert dashboards_mount.split(":")[1] == provider["options"]["path"]


def test_dockerfile_copies_what_exists_and_runs_the_cli() -> None:
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert 'ENTRYPOINT ["m3gate"]' in dockerfile
    ignore = (COMPOSE_DIR / "Dockerfile.dockerignore").read_text().splitlines()
    copied = {s.rstrip("/") for line in dockerfile.splitlines() if line.startswith("COPY") and "--from" not in line
              for s in line.split()[1:-1]}
    assert copied <= {line.lstrip("!").rstrip("/") for line in ignore if line.startswith("!")}


@pytest.mark.parametrize(("tool", "args"), [
    ("promtool", ["check", "config", "prometheus.yml"]),
    ("haproxy", ["-c", "-f", "haproxy.cfg"]),  # names resolve only inside compose: init-addr none lets it start
])
def test_config_files_pass_their_own_tools_check(tool: str, args: list[str]) -> None:
    require_tools(tool)
    result = subprocess.run([tool, *args], check=False, cwd=COMPOSE_DIR, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
