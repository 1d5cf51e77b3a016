"""The live status page: GET /ui (static HTML/JS/CSS from gateway/static/, no build step, nothing fetched from
elsewhere), GET /ui/state, the JSON it polls, and GET /ui/access, which tells the page whether it needs a key.

/ui/state is guarded like /admin (the admin key as a bearer token; the page keeps it in sessionStorage, never in a
URL); with `admin.ui_open_on_loopback` loopback clients need no key. /ui/access answers everyone with a 200 (key
needed? this key accepted?), so that the page never logs a refused request. /ui/state reads what the gateway already
keeps: the pools' replicas (gateway/admin.py's view), the traffic classes' queues (gateway/admission.py), the config
reload status, the gateway's own latency histograms (per-class TTFT / TPOT percentiles over the last five minutes,
from bucket deltas against the history's oldest snapshot), the latest requests' stages
(gateway/observability/recent.py), the agent sessions (gateway/sessions.py) and the chart points of the last 15 minutes
newer than `?history_since=` (gateway/observability/history.py).

Apart from the history's sampler (one sample every 5 s), nothing here runs unless the page polls; the
recent-requests ring records only while polls keep coming.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin import LOOPBACK, check_admin, replica_view
from gateway.errors import error_response
from gateway.observability.history import History, class_counts, delta
from gateway.runtime import Gateway
from policies.contract import histogram_quantile
from policies.traffic import pool_class

STATIC = {"ui.js": "text/javascript; charset=utf-8", "ui.css": "text/css; charset=utf-8"}
_SECURITY_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


class UiState:
    """The page's static files, read once."""

    def __init__(self) -> None:
        self._static: dict[str, bytes] = {}

    def static(self, name: str) -> bytes:
        data = self._static.get(name)
        if data is None:
            data = self._static[name] = resources.files("gateway").joinpath("static", name).read_bytes()
        return data


def _latency(gw: Gateway, history: History | None, now: float) -> dict[str, Any]:
    """Per class, latency percentiles and rates from now back to the history's oldest snapshot (at most five
    minutes old; since the gateway started before the first)."""
    counts = class_counts(gw)
    if counts is None:
        return {"enabled": False}
    base = history.baseline(now) if history is not None else None
    window_s = (now - base[0]) if base is not None else None
    req = gw.telemetry.metrics.requests  # type: ignore[union-attr]
    bounds = {"ttft": req.ttft.bounds, "tpot": req.tpot.bounds, "e2e": req.e2e.bounds}
    classes: dict[str, Any] = {}
    for cls, kinds in counts.items():
        before = base[1].get(cls, {}) if base is not None else {}
        row: dict[str, Any] = {}
        for kind in ("ttft", "tpot", "e2e"):
            if kind not in kinds:
                continue
            counted = delta(kinds[kind], before.get(kind))
            n = int(round(sum(counted[:-1])))
            row[kind] = {"n": n, **{f"p{p}_ms": _ms(histogram_quantile(p / 100, bounds[kind], counted))
                                     for p in (50, 95, 99)}}
        for kind in ("requests", "r429"):
            total = kinds.get(kind, [0.0])[0]
            old_total = before.get(kind, [0.0])[0]
            row[f"{kind}_total"] = int(total)
            row[f"{kind}_per_s"] = round((total - old_total) / window_s, 3) if window_s else None
        routed = sum(kinds["e2e"][:-1]) if "e2e" in kinds else 0.0  # sent to a replica: admitted
        routed_before = sum(before["e2e"][:-1]) if "e2e" in before else 0.0
        row["admitted_per_s"] = round((routed - routed_before) / window_s, 3) if window_s else None
        classes[cls] = row
    return {"enabled": True, "window_s": None if window_s is None else round(window_s, 1), "classes": classes}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _pools(gw: Gateway, now: float) -> list[dict[str, Any]]:
    view = replica_view(gw)
    config = gw.config
    by_size = config.pools_by_size()
    sizing = gw.capacity.entries  # the capacity signal per (pool, role) (gateway/capacity/signal.py)
    out = []
    for name, pool_view in view.items():
        runtime = gw.pools[name]
        precise = gw.precise.pools.get(name) if hasattr(gw.precise, "pools") else None
        freshness: dict[str, Any] = {}
        if precise is not None:
            try:
                for stats in precise.hub.stats().values():
                    freshness[stats["replica"]] = {"connected": stats.get("connected"),
                                                   "stale_reason": stats.get("stale_reason"),
                                                   "blocks": stats.get("blocks"), "last_seq": stats.get("last_seq")}
            except Exception:  # noqa: BLE001 - the page shows what it can
                pass
        replicas = []
        for url, r in pool_view["replicas"].items():
            replica = runtime.replicas[url]
            scraped = replica.scraped
            hit_rate = (scraped.prefix_hits / scraped.prefix_queries
                        if scraped is not None and scraped.prefix_queries else None)
            if not r["healthy"]:  # a replica that stopped listening is down, whatever drained it
                state = "unhealthy"
            elif r["draining"]:
                state = "draining"
            elif r["ejected_for_s"] > 0:
                state = "ejected"
            else:
                state = "available" if r["available"] else "unavailable"
            replicas.append({"url": url, "state": state, **r,
                             "prefix_hit_rate": None if hit_rate is None else round(hit_rate, 4),
                             "exact_index": freshness.get(url)})
        launch = runtime.config.launch
        out.append({
            "name": name, "max_model_len": pool_view["max_model_len"], "modalities": pool_view["modalities"],
            "class": pool_class(config.traffic, by_size, name), "policy": pool_view["policy"],
            "precise": precise is not None,
            "launch_replicas": launch.replicas if launch is not None else None,
            "available": sum(1 for r in replicas if r["state"] == "available"), "replicas": replicas,
            "background": [{"class": cls, **lane} for cls, lane in gw.traffic.admission.lanes(name).items()],
            "capacity": [{"role": role, "current": e["current"], "desired": e["desired"], "bottleneck": e["bottleneck"]}
                         for (pool, role), e in sorted(sizing.items()) if pool == name],
        })
    return out


def _classes(gw: Gateway) -> list[dict[str, Any]]:
    view = gw.traffic.view()
    queued: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    for pool in view["pools"].values():
        for cls, c in pool["classes"].items():
            queued[cls] = queued.get(cls, 0) + c["queued"]
            in_flight[cls] = in_flight.get(cls, 0) + c["in_flight"]
    out = []
    for name, cls in sorted(gw.config.traffic.classes.items(), key=lambda kv: (kv[1].priority, kv[0])):
        targets = {metric: dict(items) for metric, items in cls.latency_targets().items()}
        out.append({"name": name, "priority": cls.priority, "queued": queued.get(name, 0),
                    "in_flight": in_flight.get(name, 0), "queue_length": cls.queue_length,
                    "max_concurrency": cls.max_concurrency, "targets_ms": targets})
    return out


def _sessions(gw: Gateway) -> dict[str, Any] | None:
    """The agent-sessions panel's data (what GET /admin/sessions answers, the latest 30, without the per-turn
    detail the panel does not show), in the same poll."""
    if gw.sessions is None:
        return None
    view = gw.sessions.view(30)
    for sessions in view.values():
        for session in sessions:
            session.pop("recent_turns", None)
    return {**view, "open_sessions": len(gw.sessions.store)}


def state(gw: Gateway, reloader: Any, history: History | None = None,
          history_since: float | None = None, batch: Any = None) -> dict[str, Any]:
    now = gw.clock()
    wall = time.time()
    gw.recent.watched(now)
    return {
        "at": wall,
        "model": gw.config.model,
        "health_interval_s": gw.config.server.health_interval_s,
        "pools": _pools(gw, now),
        "classes": _classes(gw),
        "latency": _latency(gw, history, now),
        "recent": gw.recent.view(now, wall),
        "reload": reloader.status.as_json() if reloader is not None else None,
        "sessions": _sessions(gw),
        "sessions_api": gw.sessions is not None,  # GET /admin/sessions answers (else 404)
        "history": history.view(history_since) if history is not None else None,
        "batch": batch.view() if batch is not None else None,  # the Batch API's active jobs (None: it is off)
    }


# ----------------------------------------------------------------------------------------------------------------
# HTTP


def _ui_state_of(request: Request) -> UiState:
    ui = getattr(request.app.state, "ui", None)
    if ui is None:
        ui = request.app.state.ui = UiState()
    return ui


def _disabled(request: Request) -> Response | None:
    if not request.app.state.gateway.config.admin.ui:
        return Response("the status page is off (admin.ui: false)\n", 404, media_type="text/plain")
    return None


def _open_without_key(request: Request) -> bool:
    admin = request.app.state.gateway.config.admin
    return admin.ui_open_on_loopback and request.client is not None and request.client.host in LOOPBACK


async def page(request: Request) -> Response:
    """The page itself holds no data: it is served to anyone who may reach /ui; its data needs the admin key."""
    if (off := _disabled(request)) is not None:
        return off
    return Response(_ui_state_of(request).static("index.html"), media_type="text/html; charset=utf-8",
                    headers=_SECURITY_HEADERS)


async def asset(request: Request) -> Response:
    if (off := _disabled(request)) is not None:
        return off
    name = request.path_params["name"]
    if name not in STATIC:
        return Response("not found\n", 404, media_type="text/plain")
    return Response(_ui_state_of(request).static(name), media_type=STATIC[name], headers=_SECURITY_HEADERS)


async def access(request: Request) -> Response:
    """GET /ui/access, open to anyone who may load the page: whether this client needs the admin key for /ui/state
    and whether the key it sends (if any) is accepted, always with a 200. The page asks here before its first poll
    and when a key is typed in, so a normal visit never meets a 401 or 403 (which browsers log as errors)."""
    if (off := _disabled(request)) is not None:
        return off
    admin = request.app.state.gateway.config.admin
    if _open_without_key(request):
        body: dict[str, Any] = {"key_needed": False, "allowed": True, "message": None}
    else:
        refused = check_admin(request)
        if admin.api_key is None:  # loopback only, no key can open it
            body = {"key_needed": False, "allowed": refused is None,
                    "message": None if refused is None else "The status page answers loopback clients only until "
                    "admin.api_key is set."}
        else:
            sent = bool(request.headers.get("authorization"))
            body = {"key_needed": True, "allowed": refused is None,
                    "message": "That is not the admin key." if sent and refused is not None else None}
    return JSONResponse(body, headers={"cache-control": "no-store"})


async def ui_state(request: Request) -> Response:
    if (off := _disabled(request)) is not None:
        return off
    gw: Gateway = request.app.state.gateway
    if not _open_without_key(request) and (denied := check_admin(request)) is not None:
        return denied
    raw_since = request.query_params.get("history_since")
    try:
        since = float(raw_since) if raw_since else None
    except ValueError:
        return error_response(400, "`history_since` must be a time in seconds since the epoch (the newest point's "
                              "`t` the page has).", param="history_since", code="invalid_value")
    app = request.app.state
    body = state(gw, getattr(app, "reloader", None), getattr(app, "history", None), since, getattr(app, "batch", None))
    return JSONResponse(body, headers={"cache-control": "no-store"})


def ui_routes() -> list[Route]:
    return [
        Route("/ui", page, methods=["GET"]),
        Route("/ui/", page, methods=["GET"]),
        Route("/ui/access", access, methods=["GET"]),
        Route("/ui/state", ui_state, methods=["GET"]),
        Route("/ui/static/{name}", asset, methods=["GET"]),
    ]
