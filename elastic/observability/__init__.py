"""Observability: the event log, Prometheus metrics, `elastic status`, the timeline and the report."""
