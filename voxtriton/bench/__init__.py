"""Benchmark harness code that the scripts in benchmarks/ run and the tests check."""
