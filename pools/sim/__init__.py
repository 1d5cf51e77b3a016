"""A vLLM-faithful simulated replica of `vllm serve MiniMaxAI/MiniMax-M3` (vLLM 0.32).

Why it exists: the gateway's routing, admission and relay logic must be exercised against something that queues,
batches, caches prefixes and fails the way a real replica does, without GPUs. One process, one asyncio loop:
`app` speaks vLLM's HTTP contract, `engine` models continuous batching over a paged KV cache with a prefix cache,
`metrics` exposes what the engine actually did under vLLM's metric names.

Entry points: `m3gate sim ...` (see `cli.py`) and `pools.sim.launcher.start_sim(...)` for tests.
"""
