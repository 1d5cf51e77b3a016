"""The load-test library: workloads, the client, the harness, reports and plots, the oracle, simulated replicas and reference proxies."""
