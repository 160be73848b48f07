"""The worker side: the worker actor, its step, process groups and abortable collectives, heartbeat, chaos."""
