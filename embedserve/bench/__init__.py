"""Benchmarks (load generators and side-by-side peer runs)."""
