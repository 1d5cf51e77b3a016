"""The benchmarks, one module each: `python -m loadtests.bench.NAME [--quick]`; `python -m loadtests.bench
[--quick]` runs the short versions and prints one table from their results.json (`make bench`)."""
