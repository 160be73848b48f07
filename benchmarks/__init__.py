"""Benchmarks users run on their own clusters, from a checkout: `python -m benchmarks recovery`."""
