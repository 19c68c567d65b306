"""Tracked benchmarks: ``python -m benchmarks.bench_NAME`` writes docs/benchmarks/data/*.json."""
