"""The Ray actor of one rank, importable without torch: the controller starts workers, and names
their methods, without loading torch (a controller that imported the worker module spent about 4 s
importing torch, DTensor and DCP before its first event, on every run's start; it never trains).

`WorkerActor` builds the real `Worker` (elastic/runtime/worker.py) in the actor's own process and
forwards each remote method to it. `REMOTE_METHODS` is the worker's remote interface: a test checks
it against the Worker class, so a method added there and called through a handle is not missed.
"""
from __future__ import annotations

REMOTE_METHODS = (
    # elastic/runtime/worker.py
    "info", "ping", "where", "warm", "restore_priority", "calibrate", "request_stop", "restore",
    "restore_from_peer", "offer_shards", "restore_from_shards", "hold_copy", "memory_part", "state_digest",
    "run", "save_again", "poll",
    # elastic/runtime/membership.py
    "join", "abort", "leave",
)


class WorkerActor:
    def __init__(self, job_json: str, checkpoints_root: str, controller=None):
        from elastic.runtime.worker import Worker  # torch and the rest: in the worker's process only
        self.worker = Worker(job_json, checkpoints_root, controller)


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.worker, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Worker.{name} (elastic/runtime/worker.py)."
    return method


for _name in REMOTE_METHODS:
    setattr(WorkerActor, _name, _forward(_name))
