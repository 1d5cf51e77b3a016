"""The engine's KV-transfer paths with a stand-in connector, time driven by hand: a pulled prompt is parked out of
the batch, rejoins with one token to compute and fills the prefix cache; failed pulls fail or recompute; a finished
prefill-side request's blocks stay allocated while the connector holds them."""

from __future__ import annotations

from typing import Any

from pools.sim.engine import SimRequest
from tests.unit.test_sim_engine import (
    make_engine,
    request,
    run_until_done,
    sample,
    text_of,
)


class FakeConnector:
    def __init__(self, hold: bool = False) -> None:
        self.loads: list[tuple[SimRequest, int]] = []
        self.finished: list[tuple[str, str]] = []
        self.hold = hold

    def start_load(self, req: SimRequest, num_blocks: int) -> None:
        self.loads.append((req, num_blocks))

    def request_finished(self, req: SimRequest, reason: str, now: float) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((req.request_id, reason))
        held = self.hold and reason in ("stop", "length")
        return held, {"remote_block_ids": [list(req.blocks)]} if held else None


def remote(engine: Any, text: str, output: int = 3) -> SimRequest:
    req = request(engine, text, output)
    req.kv_transfer = {"do_remote_prefill": True}
    req.remote_prefill = True
    return req


def test_pulled_prompt_is_parked_then_computes_only_its_last_token() -> None:
    engine, metrics, clock = make_engine(blocks=64, block_size=16)
    conn = FakeConnector()
    engine.connector = conn
    req = remote(engine, text_of(100, "a"))
    engine.submit(req)
    assert engine.step_now() == 0  # admitted into "loading": no batch slot, no token budget
    assert req.status == "loading" and engine.loading == [req]
    assert conn.loads == [(req, 7)] and len(req.blocks) == 7  # ceil(100 / 16), none cached here
    engine.finish_load(req, True)
    assert req.status == "waiting" and req.num_computed == 99
    assert engine.step_now() == 1
    assert req.num_output == 1 and sample(metrics, "vllm:iteration_tokens_total_sum") == 1.0
    run_until_done(engine, clock, req)
    assert (req.cached_tokens, req.external_tokens, req.finish_reason) == (100, 100, "length")
    assert sample(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 100
    assert sample(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    again = request(engine, text_of(100, "a"))  # the pulled blocks are in the prefix cache
    engine.submit(again)
    run_until_done(engine, clock, again)
    assert again.cached_tokens == 96


def test_local_prefix_hits_are_not_pulled() -> None:
    engine, _, clock = make_engine(blocks=64, block_size=16)
    warm = request(engine, text_of(64, "b"))
    engine.submit(warm)
    run_until_done(engine, clock, warm)
    conn = FakeConnector()
    engine.connector = conn
    req = remote(engine, text_of(100, "b")[:64 * 4] + text_of(36, "c"))
    engine.submit(req)
    engine.step_now()
    assert conn.loads == [(req, 3)]  # the warm prompt's 4 full blocks are hits here: 3 of 7 left to pull
    assert req.external_tokens == 100 - 64


def test_failed_pull_fails_the_request_or_recomputes() -> None:
    engine, metrics, clock = make_engine(blocks=64, block_size=16)
    engine.connector = FakeConnector()
    failed = remote(engine, text_of(50, "d"))
    engine.submit(failed)
    engine.step_now()
    engine.finish_load(failed, False)
    assert failed.finish_reason == "error" and engine.kv.num_free == 64 and not engine.loading
    assert sample(metrics, "vllm:request_success_total", finished_reason="error") == 1

    engine.recompute_load_failures = True
    retried = remote(engine, text_of(50, "e"))
    engine.submit(retried)
    engine.step_now()
    engine.finish_load(retried, False)
    run_until_done(engine, clock, retried)
    assert retried.finish_reason == "length" and retried.external_tokens == 0 and retried.cached_tokens == 0


def test_abort_while_loading_frees_the_blocks() -> None:
    engine, _, _ = make_engine(blocks=64, block_size=16)
    engine.connector = FakeConnector()
    req = remote(engine, text_of(50, "f"))
    engine.submit(req)
    engine.step_now()
    engine.abort(req)
    engine.finish_load(req, True)  # the pull ending later changes nothing
    assert req.finish_reason == "abort" and engine.kv.num_free == 64 and not engine.waiting


def test_connector_holds_a_finished_prefill_requests_blocks() -> None:
    engine, _, clock = make_engine(blocks=64, block_size=16)
    conn = FakeConnector(hold=True)
    engine.connector = conn
    req = request(engine, text_of(40, "g"), output=1)
    req.kv_transfer = {"do_remote_decode": True}
    engine.submit(req)
    run_until_done(engine, clock, req)
    assert req.kv_transfer_out == {"remote_block_ids": [[0, 1, 2]]}
    assert engine.kv.num_free == 61  # still allocated
    engine.release_blocks(req.kv_transfer_out["remote_block_ids"][0])
    assert engine.kv.num_free == 64
    plain = request(engine, text_of(40, "h"), output=1)  # no params: freed at once
    engine.submit(plain)
    run_until_done(engine, clock, plain)
    assert engine.kv.num_free == 64
