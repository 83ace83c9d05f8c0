"""Benchmark scripts (run as files). Installed as sglang_d3d.benchmarks for `d3d bench-serving`."""
