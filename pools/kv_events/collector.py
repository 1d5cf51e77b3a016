"""`PreciseCollector`: the Prometheus families of precise routing, read at scrape time (nothing on the hot path).

Per source the event stream's counters and the index's size and freshness; per pool how replicas were scored and
how many requests got exact hashes. Registered by the gateway's metrics (gateway/observability/metrics.py), which reads
the pools that exist at each scrape: precise pools come and go with config reloads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from pools.exact_index import ExactIndex, HybridMatcher
from pools.kv_events.subscriber import SourceStats
from pools.tokenizer import PromptHasher

__all__ = ["EventSources", "PreciseCollector"]


class EventSources(Protocol):
    """What the collector reads from the event hubs (a KvEventHub, or several as one)."""

    def clock(self) -> float: ...

    def iter_sources(self) -> Iterator[tuple[str, str, SourceStats, ExactIndex]]:
        """(pool, source key, stats, index) for every source."""
        ...


class PreciseCollector:
    """Prometheus families for precise routing, per source and per pool."""

    def __init__(self, hubs: EventSources, matchers: Callable[[], Mapping[str, HybridMatcher]],
                 hashers: Callable[[], Mapping[str, PromptHasher]]) -> None:
        self._hubs = hubs
        self._matchers = matchers  # pool → its matcher, now
        self._hashers = hashers  # pool → its prompt hasher, now

    def describe(self) -> list[Metric]:
        return []  # collected lazily (the set of families does not change, their label sets do)

    def collect(self) -> Iterator[Metric]:
        yield from self._per_source()
        yield from self._per_pool()

    def _per_source(self) -> Iterator[Metric]:
        labels = ["pool", "endpoint"]
        batches = CounterMetricFamily("m3gate_kv_event_batches", "KV event batches applied, per replica event source.",
                                      labels=labels)
        events = CounterMetricFamily("m3gate_kv_events", "KV events applied (blocks for stored/removed).",
                                     labels=[*labels, "type"])
        gaps = CounterMetricFamily("m3gate_kv_event_gaps", "Sequence gaps seen on the live stream.", labels=labels)
        replays = CounterMetricFamily("m3gate_kv_event_replays", "Replay requests, by outcome.",
                                      labels=[*labels, "outcome"])
        resyncs = CounterMetricFamily("m3gate_kv_event_resyncs", "Full rebuilds from the replay buffer (connects, "
                                      "restarts, unrecoverable gaps).", labels=labels)
        errors = CounterMetricFamily("m3gate_kv_event_decode_errors", "Undecodable or malformed batches.",
                                     labels=labels)
        blocks = GaugeMetricFamily("m3gate_exact_index_blocks", "Blocks the replica holds per its KV events.",
                                   labels=labels)
        fresh = GaugeMetricFamily("m3gate_exact_index_fresh", "1 when the replica's exact view is used for routing "
                                  "(synced, live, not silent, hashes matching the gateway's).", labels=labels)
        checks = CounterMetricFamily("m3gate_kv_event_hash_checks", "First blocks the gateway hashed from a "
                                     "BlockStored event's tokens, by whether its hash matched the replica's.",
                                     labels=[*labels, "result"])
        now = self._hubs.clock()
        seen: set[str] = set()
        for pool, key, s, index in self._hubs.iter_sources():
            lv = [pool, key]
            batches.add_metric(lv, s.batches)
            for kind, value in (("stored", s.stored), ("removed", s.removed), ("cleared", s.cleared),
                                ("ignored", s.ignored)):
                events.add_metric([*lv, kind], value)
            gaps.add_metric(lv, s.gaps)
            replays.add_metric([*lv, "ok"], s.replays - s.replay_failures)
            replays.add_metric([*lv, "failed"], s.replay_failures)
            resyncs.add_metric(lv, s.resyncs)
            errors.add_metric(lv, s.decode_errors + s.malformed)
            checks.add_metric([*lv, "match"], s.hash_checks - s.hash_mismatches)
            checks.add_metric([*lv, "mismatch"], s.hash_mismatches)
            replica = key.split("#dp", 1)[0]
            if replica not in seen:
                seen.add(replica)
                blocks.add_metric([pool, replica], index.size(replica))
                fresh.add_metric([pool, replica], float(index.fresh(replica, now)))
        yield from (batches, events, gaps, replays, resyncs, errors, blocks, fresh, checks)

    def _per_pool(self) -> Iterator[Metric]:
        scored = CounterMetricFamily("m3gate_precise_replica_scorings", "Replica scorings by where the matched "
                                     "prefix came from (exact: KV events; approx: estimate).",
                                     labels=["pool", "source"])
        fallbacks = CounterMetricFamily("m3gate_precise_fallbacks", "Replica scorings that fell back to the "
                                        "estimate, by why the exact view was not used.", labels=["pool", "reason"])
        requests = CounterMetricFamily("m3gate_precise_requests", "Requests routed in precise pools, by whether the "
                                       "gateway computed their exact block hashes.", labels=["pool", "hashes"])
        for pool, matcher in self._matchers().items():
            c = matcher.counters
            scored.add_metric([pool, "exact"], c.replicas_exact)
            scored.add_metric([pool, "approx"], c.replicas_approx)
            for reason, value in c.stale_fallbacks.items():
                fallbacks.add_metric([pool, reason], value)
        for pool, hasher in self._hashers().items():
            requests.add_metric([pool, "exact"], hasher.computed)
            requests.add_metric([pool, "none"], hasher.skipped)
        yield from (scored, fallbacks, requests)

