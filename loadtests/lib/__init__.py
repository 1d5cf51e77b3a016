"""The load-test library: workloads, the client, the harness, reports and plots, the oracle, simulated replicas,
reference proxies, and the one results format of the benchmarks (results.py)."""
