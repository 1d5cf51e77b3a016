"""`m3gate envoy-config`: an Envoy bootstrap that puts a real Envoy in front of the pools with `m3gate epp` picking
each request's replica, for running the pair locally or as a sidecar.

What it sets, and why:

- the listener's HTTP filters: first the destination header is REMOVED from the client's request (Envoy does not
  sanitise it; under fail-open a client could otherwise pick its own replica), then ext_proc to the picker, request
  body FULL_DUPLEX_STREAMED (the picker reads the body as it streams in, Envoy never buffers a whole 1M-token
  prompt for it), then the router;
- the replicas' cluster: every pool's endpoints (listed, or the DNS name a pool discovers them by: STRICT_DNS, so
  Envoy knows each replica by `ip:port`, as the picker names it) with Envoy's override-host load balancing policy,
  which sends a request to the first `ip:port` of the picker's comma-separated list and each retry to the next one
  (the fallbacks); the selected host is written back into `envoy.lb` / `x-gateway-destination-endpoint-served`.
  An ORIGINAL_DST cluster (`use_http_header`) reads a single address only, so a fallback list would be an invalid
  header to it and a fail-open request (no header) would have nowhere to go;
- one retry on a connection failure, a reset or a 5xx before the response started, as `m3gate serve` retries once;
- timeouts for 1M-token prompts and long streams: no route timeout, an hour of stream idleness, the picker's
  message timeout above the longest admission wait, buffers that hold the largest body `server.max_body_bytes`
  allows (a retry re-sends the body from Envoy's buffer);
- `failure_mode_allow` false (FailClose, the InferencePool default: the picker down means a 500, worded as an
  OpenAI error by `local_reply_config`) unless
  `fail_open` (the request then goes to a replica the fallback policy picks, least requests first); the picker's
  cluster is health-checked so that either applies to every request once the picker is known to be down (see
  `_picker_health`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import yaml

from policies.config import GatewayConfig

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
EPP_CLUSTER = "m3gate_epp"
REPLICAS_CLUSTER = "m3gate_replicas"
_T = "type.googleapis.com/envoy."


def split_host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{flag} must be HOST:PORT, not {value!r}")
    return host.strip("[]"), int(port)


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def replica_addresses(config: GatewayConfig) -> list[tuple[str, int]]:
    """Every replica the picker may name: each pool's endpoints and the DNS names pools discover replicas by
    (both sides of a disaggregated pool)."""
    found: list[tuple[str, int]] = []
    for pool in config.pools:
        urls = list(pool.endpoints)
        specs = [pool.discovery] if pool.discovery is not None else []
        split = pool.disaggregation
        if split is not None:
            for side in (split.prefill, split.decode):
                urls.extend(side.endpoints)
                if side.discovery is not None:
                    specs.append(side.discovery)
        for url in urls:
            parts = urlsplit(url)
            found.append((parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)))
        found.extend((spec.dns_name.rstrip("."), spec.port) for spec in specs)
    return list(dict.fromkeys(found))


def _ext_proc(fail_open: bool, response_processing: str, message_timeout_s: int) -> dict[str, Any]:
    full = response_processing == "full"
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
        "failure_mode_allow": fail_open,
        "message_timeout": f"{message_timeout_s}s",
        "processing_mode": {
            "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_header_mode": "SEND" if full else "SKIP",
            "response_body_mode": "FULL_DUPLEX_STREAMED" if full else "NONE",
            "response_trailer_mode": "SEND" if full else "SKIP",
        },
        # the subset hint reaches the picker; the served endpoint comes back with the response
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]}},
    }}


def _openai_local_replies() -> dict[str, Any]:
    """Envoy's own answer when the picker is unreachable under FailClose (ext_proc's local reply, details
    `ext_proc_error...`, otherwise an empty body) in OpenAI's error shape, as `m3gate serve` words its errors. The
    picker's ImmediateResponses are left alone: they already are, with the picker's status and code."""
    picker_down = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": _T + "extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": "response.code_details.startsWith('ext_proc_error')"}}}
    error = {"message": "The endpoint picker is unavailable; retry shortly.", "type": "upstream_error",
             "param": None, "code": "endpoint_picker_unavailable"}
    return {"mappers": [{"filter": picker_down, "body_format_override": {
        "json_format": {"error": error}, "content_type": "application/json"}}]}


def _listener(host: str, port: int, filters: Sequence[Mapping[str, Any]], buffer_bytes: int) -> dict[str, Any]:
    route = {"cluster": REPLICAS_CLUSTER, "timeout": "0s", "idle_timeout": "3600s",
             "retry_policy": {
                 "retry_on": "5xx,refused-stream", "num_retries": 1,
                 # a fail-open request's fallback-policy pick may be a dead replica: retry somewhere else
                 "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                     "@type": _T + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                 "host_selection_retry_max_attempts": 5}}
    manager = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "m3gate", "codec_type": "AUTO",
        "stream_idle_timeout": "3600s", "request_timeout": "0s", "request_headers_timeout": "60s",
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "route_config": {"name": "m3gate", "virtual_hosts": [{
            "name": "m3gate", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": route,
                        "request_body_buffer_limit": buffer_bytes,
                        "response_headers_to_add": [{
                            "header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}],
        }]},
        "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": _T + "extensions.filters.http.router.v3.Router"}}],
        "local_reply_config": _openai_local_replies(),
    }
    return {"name": "m3gate", "address": _address(host, port), "per_connection_buffer_limit_bytes": 8 << 20,
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": manager}]}]}


def _clusters(config: GatewayConfig, epp: tuple[str, int]) -> list[dict[str, Any]]:
    limits = {"thresholds": [{"max_connections": 100_000, "max_pending_requests": 100_000,
                              "max_requests": 100_000, "max_retries": 10_000}]}
    override_host = {
        "@type": _T + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [{"header": DESTINATION}],
        "fallback_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.least_request",
            "typed_config": {"@type": _T + "extensions.load_balancing_policies.least_request.v3.LeastRequest"}}}]},
    }
    replicas = {
        "name": REPLICAS_CLUSTER, "type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "5s", "circuit_breakers": limits,
        "per_connection_buffer_limit_bytes": 8 << 20,
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host", "typed_config": override_host}}]},
        "load_assignment": {"cluster_name": REPLICAS_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(host, port)}} for host, port in replica_addresses(config)]}]},
    }
    picker = {
        "name": EPP_CLUSTER, "type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED", "connect_timeout": "5s",
        "circuit_breakers": limits, **_picker_health(),
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {
                "initial_stream_window_size": 16 << 20, "initial_connection_window_size": 64 << 20}}}},
        "load_assignment": {"cluster_name": EPP_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(*epp)}}]}]},
    }
    return [picker, replicas]


def _picker_health() -> dict[str, Any]:
    """Envoy must KNOW the picker is down before a request's body arrives: ext_proc falls open only when its gRPC
    stream fails before the first body chunk went into it (Envoy 1.40's `Filter::failureModeAllow()` is false once a
    FULL_DUPLEX_STREAMED body was received). A picker host that failed its gRPC health check (`liveness`, every
    second) or was ejected after one refused connection leaves the cluster with no healthy host; with the panic
    threshold at 0 the stream then fails inside `decodeHeaders`, before any body, and fail-open (or fail-closed)
    applies to every request. A passing check brings the picker back within a second."""
    return {
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "health_checks": [{"timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
                           "unhealthy_threshold": 1, "healthy_threshold": 1,
                           "grpc_health_check": {"service_name": "liveness"}}],
        "outlier_detection": {"split_external_local_origin_errors": True, "consecutive_local_origin_failure": 1,
                              "interval": "1s", "base_ejection_time": "2s", "max_ejection_time": "10s",
                              "max_ejection_percent": 100},
    }


def envoy_bootstrap(config: GatewayConfig, epp: str, listen: str, *, fail_open: bool = False,
                    admin: str | None = None, response_processing: str = "full",
                    extra_filters: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The bootstrap as a dict. `extra_filters`: HTTP filters placed after the header removal and before ext_proc
    (the tests put a header-to-metadata filter there to set a subset hint)."""
    epp_at, listen_at = split_host_port(epp, "--epp"), split_host_port(listen, "--listen")
    waits = [c.max_queue_wait_s for c in config.traffic.classes.values()] or [0.0]
    message_timeout = int(max(600.0, max(waits) + config.limits.body_read_timeout_s + 60))
    remove = {"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": _T + "extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": DESTINATION}]}}}
    buffer_bytes = config.server.max_body_bytes + (1 << 20)
    filters = [remove, *extra_filters, _ext_proc(fail_open, response_processing, message_timeout)]
    bootstrap: dict[str, Any] = {
        "static_resources": {"listeners": [_listener(*listen_at, filters, buffer_bytes)],
                             "clusters": _clusters(config, epp_at)},
    }
    if admin:
        bootstrap["admin"] = {"address": _address(*split_host_port(admin, "--admin"))}
    return bootstrap


def envoy_yaml(bootstrap: Mapping[str, Any]) -> str:
    header = ("# Envoy bootstrap generated by `m3gate envoy-config` (docs/epp.md): Envoy in front of the pools,\n"
              "# `m3gate epp` picking each request's replica over ext_proc.\n")
    return header + yaml.safe_dump(dict(bootstrap), sort_keys=False)
