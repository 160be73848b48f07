"""The worker group: placement, ranks, spares and process-group (re)formation."""
