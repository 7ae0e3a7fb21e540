"""Benchmarks: make bench (bench/run.py) and the naive baseline server."""
