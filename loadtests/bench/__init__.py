"""The benchmarks, one module each: `python -m loadtests.bench.NAME [--quick]`; `python -m loadtests.bench [--quick]` runs them all (`make bench`)."""
