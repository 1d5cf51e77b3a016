"""The robustness suites: chaos (faults injected under load), fuzz (schema-driven and hostile inputs), soak
(minutes of mixed load)."""
