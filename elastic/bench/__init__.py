"""Benchmarks users run on their own clusters: `elastic bench recovery`."""
