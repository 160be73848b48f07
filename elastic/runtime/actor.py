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
        Worker = import_worker()
        self.worker = Worker(job_json, checkpoints_root, controller)


def import_worker():
    """elastic.runtime.worker, with torch, DTensor and DCP: in the worker's process only.

    The cyclic garbage collector is off while they import: torch's import allocates hundreds of
    thousands of objects and would trigger dozens of collections that find nothing to free;
    without them the import (dynamo's included) took 2.4-3.0 s of CPU instead of 2.9-3.6 s, on
    every rank's and spare's start (Ray actors on this project's 2-core machine, three at once).
    What the import made is frozen at once (gc.freeze: modules, functions and classes, alive for
    the process's life): re-enabled with all of it in the youngest generation, the collector's
    next pass would scan it all. Worker.__init__ freezes what its set-up adds the same way."""
    import gc
    enabled = gc.isenabled()
    gc.disable()
    try:
        from elastic.runtime.worker import Worker
        # torch.optim imports dynamo lazily, on the first optimizer built (Optimizer.__init__ is
        # wrapped by torch._disable_dynamo): every rank paid it inside its first restore, which
        # took 0.84-1.1 s for the 3-rank workload from init, 0.05 s with dynamo imported here.
        import torch._dynamo  # noqa: F401
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    return Worker


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.worker, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Worker.{name} (elastic/runtime/worker.py)."
    return method


for _name in REMOTE_METHODS:
    setattr(WorkerActor, _name, _forward(_name))
