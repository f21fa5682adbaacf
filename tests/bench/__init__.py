"""The benchmark harness and the benchmark scripts."""
