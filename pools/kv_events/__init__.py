"""KV-cache events from vLLM replicas, kept as pools.exact_index's view of which blocks each replica holds.

- `decoding`: a published batch's msgpack payload → events (both layouts vLLM has used);
- `sources`: where a replica's publishers are (config or `GET /kv_event_sources`), one source per DP rank;
- `subscriber`: one source followed in sequence, with replays for gaps and resyncs after restarts;
- `hub`: the subscriptions of a set of replicas, kept in step with config reloads and discovery;
- `collector`: their Prometheus families, read at scrape time.

The gateway's side (one `PrecisePool` per pool that routes precisely) is gateway/precise_pool.py.
"""
