"""The plain data a replica-choice policy reads and returns.

The gateway builds these at decision time from what `pools/` knows (health, scraped metrics, in-flight guards), hands
them to a policy, and acts on the `RoutingDecision`. Keeping them read-only (frozen, or for the per-replica
snapshot by convention) and free of behaviour is what lets policies stay pure and tests craft any situation in one
line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class ReplicaSnapshot:
    """What the gateway knows about one replica at decision time.

    Read-only by convention; not frozen because a frozen dataclass is ~4x slower to build, and the gateway builds
    one per replica several times per request (admission's saturation check, replica choice). `Replica.snapshot`
    passes the fields by position: keep their order in step with it."""

    url: str
    pool: str
    healthy: bool = True  # active health + passive ejection folded in by the gateway
    draining: bool = False
    in_flight: int = 0  # the gateway's own in-flight requests to it
    in_flight_tokens: int = 0  # their prompt+output token estimates
    waiting: float | None = None  # scraped vllm:num_requests_waiting (None = never scraped)
    running: float | None = None  # scraped vllm:num_requests_running
    kv_usage: float | None = None  # scraped vllm:kv_cache_usage_perc, 0..1
    metrics_age_s: float | None = None  # seconds since the last successful scrape (None = never)
    prefill_s_per_token: float = 60e-6  # EWMA of observed TTFT per uncached prompt token
    tpot_s: float = 0.02  # EWMA of time per output token
    kv_blocks: int | None = None  # KV cache capacity in blocks (config or vllm:cache_config_info)
    block_size: int = 128  # the replica's --block-size
    prefill_tokens: int = 0  # uncached prompt tokens this gateway sent it that have not reached a first token
    step_starts_in: float = 0.0  # the replica's virtual step clock (policies/latency_model.prefill_plan): the last
    step_ends_in: float = 0.0  # planned prefill step's start and end, seconds from now (≤ 0: passed)
    step_tokens: int = 0  # and the uncached tokens planned into it


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """The few facts about a request that replica choice needs (the classifier computes them)."""

    prompt_tokens: int
    output_budget: int
    block_hashes: tuple[int, ...] = ()  # chained prefix-block hashes (policies/prefix.py)
    session_key: str | None = None  # x-session-id header or body `user`
    exact_block_hashes: tuple[int, ...] = ()  # vLLM's own block hashes of the prompt (policies/vllm_hash.py), when
    # the pool routes precisely and the gateway could tokenize the request exactly; () otherwise
    ttft_slo_s: float | None = None  # the request's TTFT objective (x-slo-ttft-ms, else its class's target)
    tpot_slo_s: float | None = None  # its time-per-output-token objective (x-slo-tpot-ms), if any
    output_estimate: int = 0  # the tokens it is expected to generate (policies/output_estimate.py); 0: none made,
    # the budget stands for them. Load and KV headroom read `expected_output`; a pool's fit always the budget

    @property
    def expected_output(self) -> int:
        return self.output_estimate or self.output_budget


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where to send a request, what to try next, and why (for headers, spans and the admin API)."""

    replica: str  # url
    fallbacks: tuple[str, ...]  # next-best replicas in order (for a retry before the first byte)
    reason: str  # "round_robin" | "least_loaded" | "affinity_hit" | "load_spill" | "cold_rendezvous" | "session" ...
    predicted_ttft_s: float | None
    matched_blocks: int
    scores: Mapping[str, float] = field(default_factory=dict)  # per replica url, higher is better
    predicted_ttft_p90_s: float | None = None  # calibrated P90 of the chosen replica's TTFT (policies/latency_model)
    runner_up_ttft_s: float | None = None  # predicted TTFT of the best replica not chosen
    predicted_tpot_s: float | None = None  # the chosen replica's time per output token (its EWMA)
    features: tuple[float, ...] | None = None  # the chosen replica's calibration inputs, to learn from its answer
    slo_met: bool | None = None  # with an SLO: whether the chosen replica is predicted to meet it
    prefill_plan: tuple[float, int, float] | None = None  # the chosen replica's step: (wait before it, its tokens,
    # predicted TTFT), for the replica's step clock at the send and the pool's cost model at the first token


class NoReplicaAvailable(Exception):
    """Every replica was filtered out (unhealthy or draining): the gateway answers 503 or spills to another pool."""

    def __init__(self, pool: str | None, considered: int, why: str = "no healthy, non-draining replica"):
        self.pool = pool
        self.considered = considered
        self.why = why
        where = f"pool {pool!r}" if pool else "the candidate set"
        super().__init__(f"{why} in {where} ({considered} considered)")
