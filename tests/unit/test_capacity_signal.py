"""gateway/capacity/signal.py in a real (unstarted) gateway: finished requests become the demand the sizing model is
fed, the signal is exported as m3gate_pool_desired_replicas{pool,role} beside m3gate_pool_replicas (both roles of a
disaggregated pool), GET /admin/capacity explains it, and the decode step cost is learnt from the streams' gaps."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.record import RequestRecord
from pools.replicas import ScrapedLoad
from policies.capacity import ClassDemand, EngineCosts, size
from policies.config import GatewayConfig

MODEL = "MiniMaxAI/MiniMax-M3"
CONFIG = {
    "model": MODEL,
    "pools": [
        {"name": "chat", "max_model_len": 32768, "kv_blocks": 4000,
         "endpoints": ["http://127.0.0.1:9", "http://127.0.0.1:10"], "capacity": {"min_replicas": 1, "max_replicas": 40}},
        {"name": "long", "max_model_len": 131072, "kv_blocks": 8000,
         "disaggregation": {"prefill": {"endpoints": ["http://127.0.0.1:11"]},
                            "decode": {"endpoints": ["http://127.0.0.1:12", "http://127.0.0.1:13"]}}},
    ],
    "traffic": {"classes": {"interactive": {"targets": {"ttft_ms": {"p95": 1000}, "tpot_ms": {"p95": 50}}},
                            "repository": {"priority": 1, "targets": {"ttft_ms": {"p95": 8000}, "tpot_ms": {"p95": 80}}}},
                "pool_classes": {"chat": "interactive", "long": "repository"}},
    "capacity": {"window_s": 10, "scale_down_stabilization_s": 30, "startup_s": 0, "interval_s": 1},
}


def _record(pool: str, cls: str, at: float, prompt: int, cached: int, output: int, gap: float = 0.02,
            replica: str = "", ttft: float = 0.2) -> RequestRecord:
    return RequestRecord(
        api="chat", stream=True, t_arrival=at, pool=pool, replica=replica, traffic_class=cls, status=200,
        prompt_tokens_est=prompt, t_sent=at, t_first_byte=at + ttft, t_last_byte=at + ttft + gap * (output - 1),
        usage={"prompt_tokens": prompt, "completion_tokens": output,
               "prompt_tokens_details": {"cached_tokens": cached}})


def _feed(app, t0: float, rate: int, seconds: int, start: int = 0, ttft: float = 0.2,  # type: ignore[no-untyped-def]
          rise: int = 0, slow_every: int = 1) -> None:
    """`rate` requests a second (+ `rise` more each second); every `slow_every`-th has TTFT `ttft`, the rest 0.2 s."""
    gw = app.state.gateway
    count = 0
    for s in range(start, start + seconds):
        n = rate + rise * (s - start)
        for i in range(n):
            at = t0 + s + i / n
            count += 1
            gw.capacity.observe(_record("chat", "interactive", at, 4000, 2500, 400, replica="http://127.0.0.1:9",
                                        ttft=ttft if count % slow_every == 0 else 0.2))
            gw.capacity.observe(_record("long", "repository", at, 60_000, 20_000, 800, replica="http://127.0.0.1:12"))
        gw.capacity.tick(t0 + s + 1)


def _metrics(app) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    body, _ = app.state.gateway.telemetry.metrics.render(None)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_finished_requests_become_the_demand_and_the_signal_is_the_models_answer() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    gw = app.state.gateway
    t0 = gw.clock()
    _feed(app, t0, rate=12, seconds=12)
    entry = gw.capacity.entries[("chat", "both")]
    demand = entry["demand"]["interactive"]
    assert demand["rate_per_s"] == pytest.approx(12.0, rel=0.1)
    assert (demand["prompt_tokens"], demand["uncached_tokens"], demand["output_tokens"]) == (4000, 1500, 400)
    assert demand["ttft_p95_target_s"] == 1.0 and demand["tpot_p95_target_s"] == 0.05
    assert entry["current"] == 2
    # the producer's answer is the pure model's for the demand it measured
    model = size("both", [_demand_of(entry)], _costs_of(entry))
    assert entry["needed_now"] == model.replicas and entry["desired"] == max(1, model.replicas)
    assert entry["bottleneck"] in ("prefill_compute", "decode_compute", "kv_memory")
    # twice the demand, twice (about) the replicas, at once
    _feed(app, t0, rate=24, seconds=12, start=12)
    doubled = gw.capacity.entries[("chat", "both")]
    assert doubled["desired"] >= 1.6 * entry["needed_now"]


def test_a_target_missed_as_measured_raises_the_signal_at_once() -> None:
    """Same demand, same costs: where the streams' TTFT p95 misses its target although the model predicts it met
    (queueing the model does not see), the demand is scaled until the model reproduces what was measured."""
    entries = {}
    for ttft, every in ((0.2, 1), (2.5, 1), (2.5, 12)):
        app = build_app(GatewayConfig.model_validate(CONFIG))
        gw = app.state.gateway
        _feed(app, gw.clock(), rate=6, seconds=12, ttft=ttft, slow_every=every)  # two replicas meet it, as modelled
        entries[(ttft, every)] = gw.capacity.entries[("chat", "both")]
    calm, slow, tail = entries[(0.2, 1)], entries[(2.5, 1)], entries[(2.5, 12)]
    # one request in twelve slow (at most 3 of the half window's 30): the p95's lower confidence bound meets the
    # target, so a tail that may be the p95's own 5 % is not a target at risk
    assert tail["risk_factor"] == 1.0 and tail["demand"]["interactive"]["measured_ttft_p95_s"] == pytest.approx(0.2)
    assert calm["risk_factor"] == 1.0 and calm["demand"]["interactive"]["measured_ttft_p95_s"] == pytest.approx(0.2)
    assert slow["demand"]["interactive"]["measured_ttft_p95_s"] == pytest.approx(2.5)
    assert slow["risk_factor"] > 1.0 and slow["desired"] > calm["desired"]
    assert slow["needed_now"] == size("both", [_demand_of(slow, slow["risk_factor"])], _costs_of(slow)).replicas


def test_a_steep_rise_is_led_by_the_start_up_and_a_steady_one_is_not() -> None:
    config = {**CONFIG, "capacity": {**CONFIG["capacity"], "startup_s": 20}}
    leads = {}
    for rise in (0, 3):
        app = build_app(GatewayConfig.model_validate(config))
        gw = app.state.gateway
        _feed(app, gw.clock(), rate=6, seconds=12, rise=rise)
        leads[rise] = gw.capacity.entries[("chat", "both")]["lead_factor"]
    assert leads[0] == 1.0  # steady: noise is not a trend
    assert leads[3] > 1.5  # +3 req/s each second against ~30 req/s, led by the 20 s start-up + half the window


def test_the_gauge_sits_beside_the_pools_replica_count_with_one_series_per_role() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    gw = app.state.gateway
    t0 = gw.clock()
    _feed(app, t0, rate=4, seconds=3)
    # the first window only measures: it asks for no fewer replicas than serve (a fresh gateway has seen too little)
    assert gw.capacity.entries[("chat", "both")]["desired"] == 2
    _feed(app, t0, rate=4, seconds=9, start=3)
    metrics = _metrics(app)
    desired = {labels: v for (name, labels), v in metrics.items() if name == "m3gate_pool_desired_replicas"}
    assert set(desired) == {(("pool", "chat"), ("role", "both")), (("pool", "long"), ("role", "prefill")),
                            (("pool", "long"), ("role", "decode"))}
    assert desired[(("pool", "chat"), ("role", "both"))] == gw.capacity.entries[("chat", "both")]["desired"]
    assert ("m3gate_pool_replicas", (("pool", "chat"),)) in metrics
    # a disaggregated pool's roles count their own replicas
    assert gw.capacity.entries[("long", "prefill")]["current"] == 1
    assert gw.capacity.entries[("long", "decode")]["current"] == 2


@pytest.mark.asyncio
async def test_admin_capacity_explains_each_pool_role() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    gw = app.state.gateway
    _feed(app, gw.clock(), rate=4, seconds=12)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        body = (await client.get("/admin/capacity")).json()
    assert body["scale_down_stabilization_s"] == 30 and body["startup_s"] == 0
    assert set(body["pools"]) == {"chat", "long"} and set(body["pools"]["long"]) == {"prefill", "decode"}
    entry = body["pools"]["chat"]["both"]
    assert {"current", "desired", "bottleneck", "predicted", "demand", "costs", "lead_factor"} <= set(entry)
    for at in ("current", "desired"):
        predicted = entry["predicted"][at]
        assert predicted["replicas"] == entry[at]
        assert set(predicted["classes"]["interactive"]) == {"ttft_p95_s", "tpot_p95_s"}
    assert entry["predicted"]["desired"]["meets_targets"] is True
    # the prefill side of a disaggregated pool predicts no TPOT; its decode side no queueing prefill
    assert body["pools"]["long"]["prefill"]["predicted"]["desired"]["classes"]["repository"]["tpot_p95_s"] == 0


@pytest.mark.asyncio
async def test_admin_capacity_is_guarded_like_the_other_admin_routes() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.get("/admin/capacity")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_forbidden"


def test_the_decode_step_is_learnt_from_the_streams_gaps() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    gw = app.state.gateway
    t0 = gw.clock()
    replica = gw.pools["chat"].replicas["http://127.0.0.1:9"]
    for i in range(400):
        replica.in_flight = (i % 8) * 4  # batch 1..29 at the time each stream ends
        batch = replica.in_flight + 1
        gap = 0.01 + 0.001 * batch
        gw.capacity.observe(_record("chat", "interactive", t0 + i, 1000, 0, 101, gap=gap,
                                    replica="http://127.0.0.1:9"))
    replica.in_flight = 0
    cost = gw.capacity.decode_costs["chat"]
    assert cost.samples == 400
    assert cost.seconds(1, 1050) == pytest.approx(0.011, rel=0.15)
    assert cost.seconds(29, 1050) == pytest.approx(0.039, rel=0.15)


def _demand_of(entry: dict, factor: float = 1.0) -> ClassDemand:  # type: ignore[type-arg]
    d = entry["demand"]["interactive"]
    return ClassDemand("interactive", d["rate_per_s"] * factor, d["prompt_tokens"], d["uncached_tokens"], d["output_tokens"],
                       d["ttft_p95_target_s"], d["tpot_p95_target_s"], d["queued"])


def _costs_of(entry: dict) -> EngineCosts:  # type: ignore[type-arg]
    return EngineCosts(**entry["costs"])


def _refusal(pool: str, cls: str, at: float, status: int, code: str) -> RequestRecord:
    return RequestRecord(api="chat", stream=True, t_arrival=at, pool=pool, traffic_class=cls, status=status,
                         error=code, prompt_tokens_est=4000, t_last_byte=at + 0.001)


def _with_refusals(status: int, code: str, every: int = 3) -> dict:  # type: ignore[type-arg]
    """6 answered requests a second for 12 s (two replicas meet the targets), and a refusal per `every`."""
    app = build_app(GatewayConfig.model_validate(CONFIG))
    gw = app.state.gateway
    t0 = gw.clock()
    for s in range(12):
        for i in range(6):
            at = t0 + s + i / 6
            gw.capacity.observe(_record("chat", "interactive", at, 4000, 2500, 400, replica="http://127.0.0.1:9"))
            if status and i % every == 0:
                gw.capacity.observe(_refusal("chat", "interactive", at, status, code))
        gw.capacity.tick(t0 + s + 1)
    return gw.capacity.entries[("chat", "both")]


def test_only_refusals_for_want_of_capacity_are_misses_and_client_errors_are_not_demand() -> None:
    served = _with_refusals(0, "")
    assert served["risk_factor"] == 1.0
    # one key over its quota (one 429 per 3 served), or malformed requests: the replicas meet every target
    for status, code in ((429, "rate_limit_exceeded"), (400, "invalid_request_error"), (413, "body_too_large")):
        entry = _with_refusals(status, code)
        assert entry["demand"]["interactive"]["rate_per_s"] == served["demand"]["interactive"]["rate_per_s"], code
        assert entry["risk_factor"] == 1.0 and entry["needed_now"] == served["needed_now"], (code, entry)
        assert entry["demand"]["interactive"]["measured_ttft_p95_s"] == pytest.approx(0.2), code
    # a replica's failure (5xx): demand that came, not a latency the replicas gave
    failed = _with_refusals(502, "upstream_error")
    assert failed["demand"]["interactive"]["rate_per_s"] > served["demand"]["interactive"]["rate_per_s"]
    assert failed["risk_factor"] == 1.0
    # refused for want of capacity: demand, and misses of the target (p95 unbounded), so the signal rises
    for status, code in ((429, "queue_full"), (429, "slo_unattainable"), (503, "queue_timeout"), (503, "no_capacity")):
        entry = _with_refusals(status, code)
        assert entry["demand"]["interactive"]["rate_per_s"] > served["demand"]["interactive"]["rate_per_s"], code
        assert entry["risk_factor"] > 1.0 and entry["needed_now"] > served["needed_now"], (code, entry)


def test_the_gauge_has_a_value_from_the_start_the_replicas_serving_within_the_bounds() -> None:
    pools = [{**CONFIG["pools"][0], "capacity": {"min_replicas": 3, "max_replicas": 40}}, CONFIG["pools"][1]]
    app = build_app(GatewayConfig.model_validate({**CONFIG, "pools": pools}))
    desired = {labels: v for (name, labels), v in _metrics(app).items() if name == "m3gate_pool_desired_replicas"}
    # no request, no tick: chat runs 2 but may not go below 3; the disaggregated pool's roles their own counts
    assert desired == {(("pool", "chat"), ("role", "both")): 3.0, (("pool", "long"), ("role", "prefill")): 1.0,
                       (("pool", "long"), ("role", "decode")): 2.0}
    gw = app.state.gateway
    gw.capacity.tick(gw.clock() + 1)  # an idle tick holds it
    assert gw.capacity.desired()[("chat", "both")] == 3 and gw.capacity.entries[("chat", "both")]["desired"] == 3


ONE_REPLICA = {**CONFIG, "pools": [{"name": "chat", "max_model_len": 32768, "endpoints": ["http://127.0.0.1:9"],
                                    "capacity": {"min_replicas": 1, "max_replicas": 40}}],
               "traffic": {"classes": {"interactive": {"targets": {"ttft_ms": {"p95": 1000}}}},
                           "pool_classes": {"chat": "interactive"}}}


def _non_streamed(at: float, queued_s: float, step_s: float = 0.04) -> RequestRecord:
    sent = at + queued_s
    return RequestRecord(
        api="chat", stream=False, t_arrival=at, pool="chat", replica="http://127.0.0.1:9", traffic_class="interactive",
        status=200, prompt_tokens_est=30, t_admitted=sent, t_sent=sent, t_headers=sent + 0.02 + 100 * step_s,
        t_first_byte=sent + 0.02 + 100 * step_s, t_last_byte=sent + 0.02 + 100 * step_s,
        usage={"prompt_tokens": 30, "completion_tokens": 100})


def _saturating(waiting: list[float], running: float) -> dict:  # type: ignore[type-arg]
    """One replica answering 1 non-streamed request a second; its scrapes say `running` and `waiting[s]`."""
    app = build_app(GatewayConfig.model_validate(ONE_REPLICA))
    gw = app.state.gateway
    replica = gw.pools["chat"].replicas["http://127.0.0.1:9"]
    t0 = gw.clock()
    for s, queued in enumerate(waiting):
        replica.scraped, replica.scraped_at = ScrapedLoad(waiting=queued, running=running, kv_usage=0.2), t0 + s
        gw.capacity.observe(_non_streamed(t0 + s, 0.0))
        gw.capacity.tick(t0 + s + 1)
    return gw.capacity.entries[("chat", "both")]


def test_full_slots_and_a_growing_queue_are_a_saturation_whatever_the_model_predicts() -> None:
    calm = _saturating([0.0] * 12, running=2)
    assert calm["desired"] == 1 and not calm["saturated"]
    growing = _saturating([float(s) for s in range(12)], running=4)
    assert growing["saturated"] and growing["desired"] >= 2, growing
    assert growing["costs"]["max_num_seqs"] == 4  # learnt: it ran 4 while others waited
    # a queue that drains is not a saturation
    draining = _saturating([0.0] * 4 + [float(12 - s) for s in range(8)], running=4)
    assert not draining["saturated"]


def test_a_non_streamed_answer_counts_its_queue_time_and_teaches_the_decode_step() -> None:
    app = build_app(GatewayConfig.model_validate(ONE_REPLICA))
    gw = app.state.gateway
    replica = gw.pools["chat"].replicas["http://127.0.0.1:9"]
    replica.scraped = ScrapedLoad(waiting=0.0, running=1.0, kv_usage=0.1)
    t0 = gw.clock()
    for s in range(12):
        for i in range(3):
            gw.capacity.observe(_non_streamed(t0 + s + i / 3, 3.0))  # each waited 3 s in the gateway's queue
        gw.capacity.tick(t0 + s + 1)
    entry = gw.capacity.entries[("chat", "both")]
    # no first token is seen, but it came 3 s at least after arrival: the 1 s target is missed as measured
    assert entry["demand"]["interactive"]["measured_ttft_p95_s"] == pytest.approx(3.0)
    # its time at the replica less the prefill is 100 decode steps of 40 ms: 3 such answers a second are more
    # than one replica decodes (the model knew nothing of them before)
    assert gw.capacity.decode_costs["chat"].seconds(1, 80) == pytest.approx(0.04, rel=0.2)
    assert entry["desired"] >= 2 and entry["predicted"]["current"]["meets_targets"] is False


def test_the_slot_limit_is_not_learnt_from_requests_waiting_for_kv_or_a_long_prefill() -> None:
    app = build_app(GatewayConfig.model_validate(ONE_REPLICA))
    gw = app.state.gateway
    replica = gw.pools["chat"].replicas["http://127.0.0.1:9"]
    t0 = gw.clock()
    for s, (kv, unprefilled) in enumerate([(0.95, 0)] * 4 + [(0.2, 100_000)] * 4):
        replica.scraped, replica.scraped_at = ScrapedLoad(waiting=3.0, running=2.0, kv_usage=kv), t0 + s
        replica.prefill_tokens = unprefilled
        gw.capacity.tick(t0 + s + 1)
    assert gw.capacity.entries[("chat", "both")]["costs"]["max_num_seqs"] is None
    replica.prefill_tokens = 0
    for s in range(8, 11):  # then it runs 2 while others wait, with room: its limit
        replica.scraped, replica.scraped_at = ScrapedLoad(waiting=3.0, running=2.0, kv_usage=0.2), t0 + s
        gw.capacity.tick(t0 + s + 1)
    assert gw.capacity.entries[("chat", "both")]["costs"]["max_num_seqs"] == 2
    replica.scraped, replica.scraped_at = ScrapedLoad(waiting=0.0, running=5.0, kv_usage=0.2), t0 + 11
    gw.capacity.tick(t0 + 12)  # it runs more: the limit was a lower bound, unknown again until seen full
    assert gw.capacity.entries[("chat", "both")]["costs"]["max_num_seqs"] is None
